"""Moving a fleet's llama.cpp: gates (:mod:`.gates`), two builds measured paired on one host (:mod:`.paired`),
the gated upgrade (:mod:`.upgrade`) and the bisect (:mod:`.bisect`). It builds on the fleet's candidate builds
(:mod:`rigctl.fleet.candidate`), the CVE floor (:mod:`rigctl.inventory.advisories`) and the bench, eval and
compare code; its records render in the report (:mod:`rigctl.analysis.report.upgrade`)."""
