"""vLLM's OpenAI-compatible server with rollhub's engine-side settings in every process of the engine.

rollhub starts its engines as ``python -m rollhub_vllm_serve ARGS`` (this directory on the engine's
``PYTHONPATH``), which takes the arguments of ``python -m vllm.entrypoints.openai.api_server`` and runs that
server. Before it does, it imports :mod:`rollhub_vllm_spin`, which caps the busy-wait of the process that
imports it (:data:`rollhub_vllm_spin.SPIN_ENV`). Nothing else: the model workers' own settings (the kept pack
sources) come with the worker extension, which vLLM imports in each model worker.

The point is the processes vLLM starts itself. They are spawned, and a spawned Python process runs the top of
the main module it was started from again (as ``__mp_main__``): this module's import below, not the server. So
the engine core gets the cap too. It reads every answer of its model worker from a shared-memory queue
whose reader spins with ``sched_yield`` for a second after each message, as the worker's own reader does: on a
CPU shared with the trainer, the engine core spent half of its time spinning. The worker extension alone
(``--worker-extension-cls``) reaches only the model workers.
"""

from __future__ import annotations

import runpy

import rollhub_vllm_spin  # noqa: F401  (the cap applies at import, in whichever process runs this line)

SERVER = "vllm.entrypoints.openai.api_server"  # the module this one runs as __main__

if __name__ == "__main__":
    # alter_sys=False: this module stays __main__, so the processes vLLM spawns import it (and the line above)
    runpy.run_module(SERVER, run_name="__main__", alter_sys=False)
