"""stepbus.trainer"""
