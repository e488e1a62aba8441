"""The jobs beyond GSM8K, each run as a module from the repository's root, for example
``python -m jobs.run_countdown``: TL;DR summarisation, red-teaming, Countdown and TBA′ on MATH."""
