"""The built-in models and datasets of the demo jobs and tests (``model.name: mlp``,
``data.dataset: synthetic``).

Their names are spelled here, without torch, so that checking a job config before it is submitted
(`ddp_hpc.config.validate`) does not import torch: ``ddp-hpc submit`` starts in a fraction of a
second instead of paying torch's import (~1.7 s of CPU) on the login node. `models.py` and
`synthetic.py` hold the objects under the same names (a test keeps the two in step)."""

MODEL_NAMES = ("linear", "mlp", "small_cnn")
DATASET_NAMES = ("synthetic",)
