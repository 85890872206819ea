"""What runs inside an instance: the dependency wait step, environment injection, exit recording.

Kept import-light: an instance without dependencies starts with the standard library only.
"""
