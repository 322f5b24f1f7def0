"""turbomq.clients"""
