"""Failure handling on the login side and in the job: retry policy, the supervisor job, the watchdog."""
