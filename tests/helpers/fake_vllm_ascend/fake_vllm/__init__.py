"""Fakes of the vLLM modules graphbuf's upstream surface reads (``forward_context``, ``config``,
``kv_cache_interface``), installed into ``sys.modules`` under their vLLM names by
``tests/unit/adapters/glue/test_plugin.py`` (the real vLLM 0.32 in the main venv does not import without
its full dependency chain). Field names are vLLM 0.23's and 0.27.1's."""
