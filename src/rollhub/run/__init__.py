"""``rollhub run``: a run built from a TOML config (pydantic-settings), its run directory and resume.

See :mod:`rollhub.run.config` for the keys, :mod:`rollhub.run.rundir` for the directory layout and
:mod:`rollhub.run.step` for the object graph of the step path.
"""
