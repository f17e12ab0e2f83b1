"""graphbuf's vllm-ascend adapter (installed as ``graphbuf.adapters.vllm_ascend``), one folder per role:

- ``glue/``: what touches vLLM and vllm-ascend: the plugin (``plugin``), the attention patch (``patch``), the
  routing of a FULL-graph batch (``routing``), what a routed call resolves (``resolve``), and every upstream
  attribute the adapter reads, in one table (``upstream``);
- ``bindings/``: the large-head attention (``large_head``) bound to graphbuf buffers and tasks: the spec's
  task factories (``attention_tasks``) and the routed decode tasks (``routed_decode``);
- ``kernels/``: the attention kernels (``attention``): NPU ops or their software stand-ins;
- ``spec/``: spec metadata of the tasks: options (``task_options``), costs (``costs``) and batch
  strategies (``strategies``).

This package file and the role packages import nothing: the vLLM plugin module must stay importable with
the standard library alone. Import the heavy parts explicitly (``bindings.large_head``,
``kernels.attention``).
"""

__all__: list[str] = []
