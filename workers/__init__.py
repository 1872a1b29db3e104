"""stepbus.workers"""
