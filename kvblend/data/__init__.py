"""Package data: the bundled demo documents (docs/*.md) and the tune calibration set.

Read through importlib.resources so it works from a wheel as well as a checkout.
"""
