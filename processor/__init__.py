"""stepbus.processor"""
