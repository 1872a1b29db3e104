"""stepbus.bus"""
