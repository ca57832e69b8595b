"""CronService: recurring messages kept installed in a DelayedQueue, safely from any number of processes.

The database rows are the schedule. Each run of a schedule is a message keyed
``\\x1fcron/{name}/{config_hash}/{due_ms}`` (see ``NAMESPACE``): processes that install the same schedule
offer the same keys, so a run exists once however many install it, and none is lost when one of them dies.

Every install is one transaction that locks the schedule's record (``{prefix}schedules``: definition,
config hash, how far runs are installed, refreshed when and by whom), reads "now" from the database (or
from the queue's injected clock) and computes the runs from it, and inserts only those due strictly after
that now and after what the previous install of the same configuration covered: an installer whose own
clock lags or leads, or a retry after a backoff, cannot re-create a run that was already consumed. The
install also deletes the schedule's runs of other configurations and coalesces missed runs. The records
are what ``delayq cron ls`` shows.

Missed runs coalesce: when runs were missed (no consumer, or no scheduler, for a while), a refresh keeps
only the latest overdue run of a schedule and cancels the older ones that nobody has started, so a long
outage yields one catch-up run, not a flood.

The package: ``schedule`` (what a schedule is, when it runs, its runs' keys), ``_store`` (the install and
uninstall transactions), ``service`` (``CronService``, ``ScheduleRunner``, ``schedules_for``) and ``_views``
(what ``delayq cron ls`` shows).
"""

from delayq.cron._store import Installed, install_schedule, uninstall
from delayq.cron._views import schedule_views
from delayq.cron.schedule import NAMESPACE, Schedule, parse_run_key, run_key, run_prefix
from delayq.cron.service import CronService, ScheduleRunner, schedules_for

__all__ = [
    "NAMESPACE",
    "CronService",
    "Installed",
    "Schedule",
    "ScheduleRunner",
    "install_schedule",
    "parse_run_key",
    "run_key",
    "run_prefix",
    "schedule_views",
    "schedules_for",
    "uninstall",
]
