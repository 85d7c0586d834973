"""Code that runs on the hosts, not on the controller.

The rigs have Python 3.11 and no rigctl, so every module here uses the standard library only:
:mod:`rigctl.jobs` copies the job runtime (:mod:`rigctl.hostside.jobrun`) and one task module (e.g.
:mod:`rigctl.hostside.bench_task`) into the job's directory on the host and runs them there in a
transient systemd unit. The controller imports the same modules for their pure helpers.
"""
