"""The fleet's hosts as Ansible and rigctl leave them: builds, model artifacts, host facts, enrolment, playbook runs."""
