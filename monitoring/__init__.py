"""turbomq.monitoring"""
