"""Many ranks: the process group and FSDP2 sharding.

The process group and its collectives (``distributed.py``) and FSDP2 sharding of the models
(``sharding.py``)."""
