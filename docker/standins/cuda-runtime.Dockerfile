# Stand-in for nvidia/cuda:VERSION-runtime-UBUNTU (see cuda-devel.Dockerfile):
# Debian bookworm with the toolkit's CUDA runtime library only (the context:
# a folder holding lib64/libcudart.so*).
ARG BASE=turbomq-test/debian:bookworm
FROM ${BASE}
COPY lib64/libcudart.so* /usr/local/cuda/lib64/
RUN echo /usr/local/cuda/lib64 > /etc/ld.so.conf.d/cuda.conf && ldconfig
ENV PATH=/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
