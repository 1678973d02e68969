"""Applies ``other_machine`` in a subprocess a test started under ``GRADGUARD_TEST_PERTURB``."""

import os

if os.environ.get("GRADGUARD_TEST_PERTURB"):  # otherwise nothing, not even torch's import, is paid
    import other_machine

    other_machine.apply()
