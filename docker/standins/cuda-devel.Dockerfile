# Stand-in for nvidia/cuda:VERSION-devel-UBUNTU, for `make compose-test` on a
# machine that reaches no image registry but has a CUDA toolkit: Debian
# bookworm with that toolkit (the build context: nvcc, headers, libraries) in
# /usr/local/cuda, and the environment the real image sets. Tagged
# nvidia/cuda:<toolkit version>-devel-standin, never under a real tag.
ARG BASE=turbomq-test/debian:bookworm
FROM ${BASE}
COPY . /usr/local/cuda/
RUN echo /usr/local/cuda/lib64 > /etc/ld.so.conf.d/cuda.conf && ldconfig
ENV PATH=/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    CUDA_HOME=/usr/local/cuda
