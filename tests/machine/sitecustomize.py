"""Applies ``other_machine`` in a subprocess a test started under ``GRADGUARD_TEST_PERTURB``."""

import other_machine

other_machine.apply()
