"""The local lab rigs: systemd-nspawn hosts on this machine for tests and ``make demo``."""
