"""Planning, before anything is allocated: the memory plan (:mod:`~graphbuf.planning.planner`), the
coverage certificate (:mod:`~graphbuf.planning.coverage`) and the capture-size proposal
(:mod:`~graphbuf.planning.sizes`)."""
