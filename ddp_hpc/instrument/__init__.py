"""Zero-code instrumentation of a script run by ``ddp_hpc.exec`` (docs/scripts.md, "What status
sees without changes").

The wrapper puts ``site/`` first on the script's PYTHONPATH; its ``sitecustomize`` runs
``boot.start`` before the script: ``ending`` (how the script's Python part ended, recorded
before native teardown), faulthandler into the rank's fault file, ``hooks.when_imported`` (a
post-import hook facility) and, once the script imports torch, ``steps`` (the step heartbeat,
data wait, loss and collective timeout, through ``ddp_hpc.report``).
"""
