"""The kernels the large-head attention calls (NPU ops or their software stand-ins). Imports nothing
itself."""
