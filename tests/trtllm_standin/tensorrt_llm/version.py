"""Stand-in for tensorrt_llm/version.py.

UNVERIFIED: the version string of main at the commits read was not available (the stored
version.py is an old 1.0.0rc4). "1.3.0rc0" is a main-like pre-release of the 1.3 line whose
layout (_torch/attention/backends/sparse/) this stand-in mirrors.
"""
__version__ = "1.3.0rc0"
