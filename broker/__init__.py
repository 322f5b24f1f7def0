"""turbomq.broker"""
