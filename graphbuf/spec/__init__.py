"""The spec: pydantic models and their semantic checks (:mod:`~graphbuf.spec.models`), the restricted
integer expressions of shape fields (:mod:`~graphbuf.spec.expr`) and the task factories a spec may name
(:mod:`~graphbuf.spec.factories`)."""
