"""Weight formats as one system: one file per way a checkpoint stores a linear weight (float, MXFP4, MXFP8,
block FP8, INT4), each with its checkpoint side and its compute side, and `registry`, the plain dicts the
loader, the expert store and quantize ask. Dense Linears get a `LinearMethod` once at load (`dense`);
routed experts a format object. Builds on formats/ (pure codecs) and ops/ (kernels); neither imports it.
"""
