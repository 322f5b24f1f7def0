"""turbomq.worker"""
