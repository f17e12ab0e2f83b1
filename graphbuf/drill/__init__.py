"""``graphbuf drill``: the drill session (:mod:`~graphbuf.drill.session`), its built-in task
(:mod:`~graphbuf.drill.options`), the padding contract (:mod:`~graphbuf.drill.padding_contract`) and
the whole-model drill (:mod:`~graphbuf.drill.model`)."""
