"""llmaccel"""
