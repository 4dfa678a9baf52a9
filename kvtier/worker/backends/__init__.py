"""Compute backends of the reference worker, behind one interface (:class:`ComputeBackend`)."""
