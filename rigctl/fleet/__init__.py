"""The fleet's hosts as Ansible and rigctl leave them: builds, model artifacts, host facts, enrolment, playbook runs;
and moving their llama.cpp: the CVE floor (:mod:`.advisories`), candidate builds served beside the current one
(:mod:`.candidate`), the gates (:mod:`.gates`), paired measurement of two builds (:mod:`.paired`) and the gated
upgrade and bisect that use them (:mod:`.upgrade`)."""
