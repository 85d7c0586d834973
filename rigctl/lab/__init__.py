"""The local lab rigs: systemd-nspawn hosts on this machine for tests and ``make demo``.

:mod:`.rigs` (:class:`~rigctl.lab.rigs.Lab`: up, down, status, the stand-in GPU's state) over :mod:`.config` (the
lab as the inventory defines it), :mod:`.network` (bridge, namespaces, the fence), :mod:`.image` (the cached
Debian base image), :mod:`.gpu` (the stand-in nvidia-smi's state, which is no GPU) and :mod:`.system` (root's
tools, processes, mounts); :mod:`.prepare` does the lab's slow one-time work into the cache; ``assets/`` holds
the files copied into each rig.
"""
