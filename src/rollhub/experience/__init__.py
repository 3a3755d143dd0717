"""The experience that flows from rollout managers to trainers, as numpy arrays end to end.

Glossary (each word means one thing in rollhub):

- **group**: the completions of one prompt, scored together (:class:`Group`); the unit the buffer queues,
  packs and serves whole, and the unit group-relative advantages compare. Its *size* is its number of
  sequences.
- **sequence**: one token row of a group (prompt then completion).
- **fragment**: ``L`` consecutive steps of one step environment (:class:`SampleFragment`), cut at
  ``fragment_length + 1`` records so the last reward and the bootstrap observation are known.
- **batch**: what a trainer receives for one optimizer update. For the buffer server it is a list of groups
  whose sizes add up to the trainer's ``batch_size`` *sequences*; for the step path it is a list of fragments.
- **step**: one environment transition (step path); *trainer step* is one optimizer update.
- **policy version**: the number of weight updates the trainer has published (initial weights: 0). Every
  item carries the version of the weights that produced it.
- **staleness**: ``trainer_version - policy_version`` of an item when it is used; bounded by
  :class:`StalenessPolicy`.

Conversion to the Atropos JSON item happens only at the HTTP edge (:mod:`rollhub.wire`).
"""

from rollhub.experience.fragment import SampleFragment
from rollhub.experience.group import Group, Ragged
from rollhub.experience.staleness import StalenessPolicy

__all__ = ["Group", "Ragged", "SampleFragment", "StalenessPolicy"]
