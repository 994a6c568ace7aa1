//! The sync loop: upstream's BoundedFrequencyRunner in front of one [`Dataplane`].
//!
//! Source events are folded into the [`Tracker`] as they arrive; the `Schedule` decides when
//! a sync runs:
//! - never before every source reported its initial sync (`Tracker::is_synced`);
//! - after a change, as soon as a token is available: tokens refill one per `min_interval` up to
//!   `burst` (upstream: `minSyncPeriod`, burst 2), so bursts of changes are batched;
//! - at least once per `max_interval` (`syncPeriod`) even without changes;
//! - after a failed sync, again after a backoff (`retry_base` doubling up to `max_interval`),
//!   with every change of the failed sync carried over to the next one.
//!
//! Every event already queued when a sync is due is folded in before it runs, so one sync
//! takes every pending change, as upstream's `syncProxyRules` does (taking one event per sync,
//! a datapath slower than the changes arrive fell behind for minutes under churn).
//!
//! Divergence from upstream, on purpose: upstream retries a failed sync after a fixed interval;
//! kproxy backs off exponentially (1 s, 2 s, 4 s … capped at `syncPeriod`), so a datapath that
//! fails persistently is not hammered while a transient failure is repaired quickly.
//!
//! A datapath can ask for a sync outside of source changes (the iptables canary monitor after
//! an external flush) through a [`SyncRequester`] handed to `Runner::set_requester`; such a
//! request is rate-limited like a change.
//!
//! The schedule is pure (it takes `now` as an argument) and unit-tested; [`Runner::run`] is
//! the thin async loop around it.
//!
//! The datapath may still be under construction when the loop starts ([`Runner::deferred`]):
//! the agent then lists Services and EndpointSlices into the tracker while the datapath loads
//! (and the other modes' leftovers are removed), so a cold start pays the longer of the two
//! rather than their sum. The first sync still waits for every source's initial list, and the
//! loop counts as started (observers' `loop_started`) only once the datapath is there.
//!
//! Health and metrics watch the loop through `SyncObserver`s (`Runner::observe`): they are
//! told when the loop starts, when source changes arrive (and whether a sync got queued), and
//! when each sync starts and finishes. Observers run on the loop's task, so they must be quick
//! (update counters, send on a channel); anything slow belongs in their own task.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{mpsc, oneshot, watch};
use tracing::{debug, info, warn};

use crate::dataplane::{Dataplane, SyncReport};
use crate::model::input::{Delta, Event};
use crate::model::tracker::Pending;
use crate::model::{ChangedSet, Snapshot, Tracker};

/// Most queued events taken into one sync (bounds the drain when sources outpace it).
const MAX_DRAINED: usize = 100_000;

/// The datapath under construction, once built (`Err`: the builder gave up); never resolves
/// when nothing is being built.
async fn arrival(
    building: &mut Option<oneshot::Receiver<Box<dyn Dataplane>>>,
) -> Result<Box<dyn Dataplane>, oneshot::error::RecvError> {
    match building {
        Some(rx) => rx.await,
        None => std::future::pending().await,
    }
}

/// Asks the sync loop for a sync as soon as the rate limit allows (upstream
/// `BoundedFrequencyRunner.Run()`); cheap to clone, callable from any thread.
#[derive(Debug, Clone, Default)]
pub struct SyncRequester(Arc<tokio::sync::Notify>);

impl SyncRequester {
    /// Requests a sync (requests before the loop looks are merged into one).
    pub(crate) fn request(&self) {
        self.0.notify_one();
    }
}

/// Timing of the sync loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunnerConfig {
    /// `minSyncPeriod`: tokens refill one per this interval.
    pub min_interval: Duration,
    /// `syncPeriod`: a sync runs at least this often.
    pub max_interval: Duration,
    /// Runs allowed back to back before `min_interval` spacing applies (upstream: 2).
    pub burst: u32,
    /// First retry delay after a failed sync; doubles per consecutive failure up to `max_interval`.
    pub retry_base: Duration,
}

impl RunnerConfig {
    /// Upstream's shape for a (minSyncPeriod, syncPeriod) pair.
    pub fn new(min_interval: Duration, max_interval: Duration) -> Self {
        RunnerConfig {
            min_interval,
            max_interval,
            burst: 2,
            retry_base: Duration::from_secs(1),
        }
    }
}

/// When to run the next sync. Pure: every method takes the current time.
#[derive(Debug, Clone)]
pub(crate) struct Schedule {
    cfg: RunnerConfig,
    tokens: f64,
    refilled_at: Instant,
    requested: bool,
    last_run: Option<Instant>,
    retry_at: Option<Instant>,
    failures: u32,
}

impl Schedule {
    pub(crate) fn new(cfg: RunnerConfig, now: Instant) -> Self {
        let burst = cfg.burst.max(1);
        Schedule {
            cfg: RunnerConfig { burst, ..cfg },
            tokens: f64::from(burst),
            refilled_at: now,
            requested: false,
            last_run: None,
            retry_at: None,
            failures: 0,
        }
    }

    /// A change arrived: run as soon as the rate limit allows.
    pub(crate) fn request(&mut self) {
        self.requested = true;
    }

    /// Whether a change is waiting for a sync.
    pub(crate) fn is_requested(&self) -> bool {
        self.requested
    }

    fn tokens_at(&self, now: Instant) -> f64 {
        let burst = f64::from(self.cfg.burst);
        if self.cfg.min_interval.is_zero() {
            return burst;
        }
        let elapsed = now
            .saturating_duration_since(self.refilled_at)
            .as_secs_f64();
        (self.tokens + elapsed / self.cfg.min_interval.as_secs_f64()).min(burst)
    }

    /// When a token will be available (now if one is).
    fn token_time(&self, now: Instant) -> Instant {
        let tokens = self.tokens_at(now);
        if tokens >= 1.0 {
            now
        } else {
            now + self.cfg.min_interval.mul_f64(1.0 - tokens)
        }
    }

    /// The instant the next sync is due (may be in the past: run now).
    pub(crate) fn next_run(&self, now: Instant) -> Instant {
        let Some(last) = self.last_run else {
            // Nothing ran yet: the first sync is due as soon as it may run.
            return now;
        };
        let mut due = last + self.cfg.max_interval;
        if self.requested {
            due = due.min(self.token_time(now));
        }
        if let Some(retry) = self.retry_at {
            due = due.min(retry.max(self.token_time(now)));
        }
        due
    }

    /// Whether a sync should start at `now`.
    #[cfg(test)]
    pub fn is_due(&self, now: Instant) -> bool {
        self.next_run(now) <= now
    }

    /// Records a sync that started at `now` and its outcome.
    pub(crate) fn ran(&mut self, now: Instant, ok: bool) {
        self.tokens = (self.tokens_at(now) - 1.0).max(0.0);
        self.refilled_at = now;
        self.requested = false;
        self.last_run = Some(now);
        if ok {
            self.failures = 0;
            self.retry_at = None;
        } else {
            self.failures += 1;
            let factor = 2u32.saturating_pow(self.failures - 1);
            let delay = self
                .cfg
                .retry_base
                .saturating_mul(factor)
                .min(self.cfg.max_interval);
            self.retry_at = Some(now + delay);
        }
    }

    /// Consecutive failed syncs.
    #[cfg(test)]
    pub fn failures(&self) -> u32 {
        self.failures
    }
}

/// What the loop publishes after each sync (health and metrics read it).
#[derive(Debug, Clone, Default)]
pub struct RunnerStatus {
    /// The sources all reported their initial sync.
    pub synced: bool,
    /// Wall-clock time of the last successful sync.
    pub last_success: Option<SystemTime>,
    /// Wall-clock time since which a change has been waiting for a sync (upstream's
    /// "last queued" timestamp); `None` when nothing waits.
    pub queued_since: Option<SystemTime>,
    pub syncs: u64,
    pub failures: u64,
    pub consecutive_failures: u32,
    pub last_report: Option<SyncReport>,
    pub last_error: Option<String>,
    /// The snapshot the datapath last programmed successfully; `None` from the start of the
    /// next sync until it succeeds (so that the tracker can build the next snapshot in place
    /// instead of copying maps of every service).
    pub snapshot: Option<Arc<Snapshot>>,
    /// Duration of the last sync.
    pub last_duration: Option<Duration>,
}

/// Source changes folded into the tracker by one event (upstream's change-tracker
/// notifications, which feed the `*_changes_total` / `*_changes_pending` metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ChangeNotice {
    /// Service notifications: 1 per add/update/delete; for a whole-state re-list, the number
    /// of services it made dirty.
    pub service_changes: usize,
    /// EndpointSlice notifications, counted the same way.
    pub endpoint_changes: usize,
    /// Services with changes not yet synced, after this event.
    pub pending: Pending,
    /// This event queued a sync (nothing was waiting before); upstream's `QueuedUpdate`.
    pub queued: bool,
}

/// How one sync attempt ended, as observers see it.
#[derive(Debug)]
pub struct SyncOutcome<'a> {
    /// The snapshot the sync was asked to program.
    pub snapshot: &'a Arc<Snapshot>,
    /// What changed since the last successful sync.
    pub changed: &'a ChangedSet,
    pub result: Result<&'a SyncReport, &'a crate::dataplane::SyncError>,
    /// The active datapath mode.
    pub mode: crate::dataplane::ProxyMode,
    /// Wall-clock time the sync started.
    pub started: SystemTime,
    pub took: Duration,
}

/// Sees the sync loop's progress (health, metrics, healthCheckNodePort servers). Every method
/// has an empty default; implementations must return quickly (they run on the loop's task).
pub(crate) trait SyncObserver: Send + Sync {
    /// The loop started (upstream: `SyncLoop` start, which marks the proxy healthy).
    fn loop_started(&self, _now: SystemTime) {}
    /// One source event was folded into the tracker.
    fn changes(&self, _notice: &ChangeNotice, _now: SystemTime) {}
    /// A sync is about to run.
    fn sync_started(&self, _now: SystemTime) {}
    /// A sync finished (successfully or not).
    fn sync_finished(&self, _outcome: &SyncOutcome<'_>) {}
}

/// The async loop: events in, syncs out.
pub struct Runner {
    cfg: RunnerConfig,
    tracker: Tracker,
    dataplane: Option<Box<dyn Dataplane>>,
    /// Where the datapath comes from while it is being built ([`Runner::deferred`]).
    building: Option<oneshot::Receiver<Box<dyn Dataplane>>>,
    status: watch::Sender<RunnerStatus>,
    /// Changes of failed syncs, handed again to the next one.
    carried: ChangedSet,
    observers: Vec<Arc<dyn SyncObserver>>,
    requests: SyncRequester,
}

impl Runner {
    pub fn new(cfg: RunnerConfig, tracker: Tracker, dataplane: Box<dyn Dataplane>) -> Self {
        Self::with(cfg, tracker, Some(dataplane), None)
    }

    /// A loop whose datapath is still being built: it arrives on `dataplane`. Events are
    /// folded into the tracker meanwhile; no sync runs (and observers are not told the loop
    /// started) before it arrives. When the sender is dropped instead (the build failed, and
    /// its error ends the agent), [`Runner::run_deferred`] returns `None`.
    pub fn deferred(
        cfg: RunnerConfig,
        tracker: Tracker,
        dataplane: oneshot::Receiver<Box<dyn Dataplane>>,
    ) -> Self {
        Self::with(cfg, tracker, None, Some(dataplane))
    }

    fn with(
        cfg: RunnerConfig,
        tracker: Tracker,
        dataplane: Option<Box<dyn Dataplane>>,
        building: Option<oneshot::Receiver<Box<dyn Dataplane>>>,
    ) -> Self {
        let (status, _) = watch::channel(RunnerStatus::default());
        Runner {
            cfg,
            tracker,
            dataplane,
            building,
            status,
            carried: ChangedSet::default(),
            observers: vec![],
            requests: SyncRequester::default(),
        }
    }

    /// Makes `requester` trigger this loop's syncs.
    pub(crate) fn set_requester(&mut self, requester: SyncRequester) {
        self.requests = requester;
    }

    /// Adds an observer of the loop's progress.
    pub(crate) fn observe(&mut self, observer: Arc<dyn SyncObserver>) {
        self.observers.push(observer);
    }

    /// A receiver of the status published after every sync.
    pub fn status(&self) -> watch::Receiver<RunnerStatus> {
        self.status.subscribe()
    }

    /// Runs until `shutdown` resolves, or until `events` closes and the changes received by then
    /// are synced. Returns the dataplane (left
    /// programmed: stopping the agent does not remove its rules, as with kube-proxy).
    pub async fn run(
        self,
        events: mpsc::Receiver<Event>,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Box<dyn Dataplane> {
        assert!(
            self.building.is_none(),
            "a deferred runner runs with run_deferred"
        );
        self.run_deferred(events, shutdown)
            .await
            .expect("a runner made with its datapath returns it")
    }

    /// [`Runner::run`] for a loop made by [`Runner::deferred`] (or not): `None` when it stopped
    /// before the datapath arrived.
    pub async fn run_deferred(
        mut self,
        mut events: mpsc::Receiver<Event>,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Option<Box<dyn Dataplane>> {
        let mut schedule = Schedule::new(self.cfg, Instant::now());
        if self.dataplane.is_some() {
            self.loop_started();
        }
        tokio::pin!(shutdown);
        let requests = self.requests.0.clone();
        let mut events_open = true;
        loop {
            let now = Instant::now();
            let ready = self.tracker.is_synced() && self.dataplane.is_some();
            let wake = if ready {
                schedule.next_run(now)
            } else {
                now + Duration::from_secs(3600)
            };
            if ready && wake <= now {
                // Every change already queued goes into this sync, as upstream's
                // syncProxyRules takes all pending changes: taking one event per sync, a
                // datapath whose syncs are slower than the changes arrive (iptables at
                // thousands of services under churn) fell behind for minutes.
                for _ in 0..MAX_DRAINED {
                    if !events_open {
                        break;
                    }
                    match events.try_recv() {
                        Ok(ev) => self.apply(ev, &mut schedule),
                        // Closed sources are noticed by the `select!` below, as before.
                        Err(_) => break,
                    }
                }
                let ok = self.sync_once().await;
                schedule.ran(now, ok);
                continue;
            }
            tokio::select! {
                biased;
                _ = &mut shutdown => break,
                built = arrival(&mut self.building) => match built {
                    Ok(dp) => {
                        self.building = None;
                        self.dataplane = Some(dp);
                        self.loop_started();
                    }
                    // The build failed: its caller reports why.
                    Err(_) => return None,
                },
                ev = events.recv(), if events_open => match ev {
                    Some(ev) => self.apply(ev, &mut schedule),
                    None => {
                        events_open = false;
                        debug!("all sources stopped");
                    }
                },
                _ = requests.notified() => {
                    debug!("sync requested by the datapath");
                    schedule.request();
                }
                _ = tokio::time::sleep_until(wake.into()) => {}
            }
            // Sources gone (tests, or a fatal source error): finish the pending sync, then stop.
            let pending_sync = self.tracker.is_synced() && schedule.is_requested();
            if !events_open && !pending_sync {
                break;
            }
        }
        self.dataplane.take()
    }

    fn loop_started(&self) {
        let started = SystemTime::now();
        for o in &self.observers {
            o.loop_started(started);
        }
    }

    fn apply(&mut self, ev: Event, schedule: &mut Schedule) {
        let before = self.tracker.pending();
        let (service_events, endpoint_events) = match &ev {
            // Lists count what they changed; watch events count one each.
            Event::Service(Delta::Apply(_) | Delta::Delete(_)) => (Some(1), Some(0)),
            Event::Service(_) => (None, Some(0)),
            Event::EndpointSlice(Delta::Apply(_) | Delta::Delete(_)) => (Some(0), Some(1)),
            Event::EndpointSlice(_) => (Some(0), None),
            Event::Node(_) | Event::ServiceCidr(_) => (Some(0), Some(0)),
        };
        for w in self.tracker.apply(ev) {
            warn!(object = %w.object, field = %w.field, "skipped: {}", w.reason);
        }
        let pending = self.tracker.pending();
        let mut queued = false;
        if pending.services + pending.endpoints > 0
            || self.tracker.service_cidrs_pending()
            || !self.tracker.is_synced()
        {
            if !schedule.is_requested() {
                queued = true;
                self.status
                    .send_modify(|s| s.queued_since = Some(SystemTime::now()));
            }
            schedule.request();
        }
        let notice = ChangeNotice {
            service_changes: service_events
                .unwrap_or_else(|| pending.services.saturating_sub(before.services)),
            endpoint_changes: endpoint_events
                .unwrap_or_else(|| pending.endpoints.saturating_sub(before.endpoints)),
            pending,
            queued,
        };
        let now = SystemTime::now();
        for o in &self.observers {
            o.changes(&notice, now);
        }
        if self.tracker.is_synced() && !self.status.borrow().synced {
            info!("all sources reported their initial sync");
            self.status.send_modify(|s| s.synced = true);
            schedule.request();
        }
    }

    /// One sync on a blocking thread. Returns whether it succeeded.
    async fn sync_once(&mut self) -> bool {
        // Let the tracker build the next snapshot in place: drop the published copy of the last
        // one first (it is published again when this sync succeeds).
        self.status.send_if_modified(|s| {
            s.snapshot = None;
            false
        });
        let snapshot_started = Instant::now();
        let (snap, changed) = self.tracker.snapshot();
        let snapshot_took = snapshot_started.elapsed();
        let mut changed_all = std::mem::take(&mut self.carried);
        changed_all.services.extend(changed.services);
        changed_all.node |= changed.node;
        let mut dp = self
            .dataplane
            .take()
            .expect("dataplane is present between syncs");
        let started = Instant::now();
        let started_wall = SystemTime::now();
        for o in &self.observers {
            o.sync_started(started_wall);
        }
        let mode = dp.mode();
        let snap2 = snap.clone();
        // Moved there and back, not cloned: on a first sync it names every service port.
        let (dp, result, changed_all) = tokio::task::spawn_blocking(move || {
            let r = dp.sync(&snap2, &changed_all);
            (dp, r, changed_all)
        })
        .await
        .expect("dataplane sync panicked");
        let took = started.elapsed();
        self.dataplane = Some(dp);
        let ok = result.is_ok();
        let outcome = SyncOutcome {
            snapshot: &snap,
            changed: &changed_all,
            result: result.as_ref(),
            mode,
            started: started_wall,
            took,
        };
        for o in &self.observers {
            o.sync_finished(&outcome);
        }
        match result {
            Ok(report) => {
                if self.status.borrow().last_success.is_none() {
                    // The first full programming is what a cold start waits for: worth one
                    // line at the default level (every later sync logs at debug).
                    info!(
                        generation = snap.generation,
                        services = report.services,
                        endpoints = report.endpoints,
                        took_ms = took.as_millis() as u64,
                        "first sync done"
                    );
                }
                debug!(
                    generation = snap.generation,
                    changed = changed_all.services.len(),
                    services = report.services,
                    endpoints = report.endpoints,
                    took_ms = took.as_millis() as u64,
                    snapshot_us = snapshot_took.as_micros() as u64,
                    "sync done"
                );
                self.status.send_modify(|s| {
                    s.syncs += 1;
                    s.consecutive_failures = 0;
                    s.last_success = Some(SystemTime::now());
                    s.queued_since = None;
                    s.last_report = Some(report);
                    s.last_error = None;
                    s.snapshot = Some(snap);
                    s.last_duration = Some(took);
                });
            }
            Err(e) => {
                warn!(generation = snap.generation, error = %e, "sync failed; will retry");
                self.carried = changed_all;
                self.status.send_modify(|s| {
                    s.syncs += 1;
                    s.failures += 1;
                    s.consecutive_failures += 1;
                    s.last_error = Some(e.to_string());
                    s.last_duration = Some(took);
                });
            }
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(min: u64, max: u64) -> RunnerConfig {
        RunnerConfig::new(Duration::from_secs(min), Duration::from_secs(max))
    }
    const S: Duration = Duration::from_secs(1);

    #[test]
    fn first_sync_is_due_immediately() {
        let t0 = Instant::now();
        let s = Schedule::new(cfg(1, 30), t0);
        assert!(s.is_due(t0));
    }

    #[test]
    fn without_changes_runs_once_per_sync_period() {
        let t0 = Instant::now();
        let mut s = Schedule::new(cfg(1, 30), t0);
        s.ran(t0, true);
        assert!(!s.is_due(t0 + 29 * S));
        assert_eq!(s.next_run(t0 + 5 * S), t0 + 30 * S);
        assert!(s.is_due(t0 + 30 * S));
    }

    #[test]
    fn burst_of_two_then_spaced_by_min_sync_period() {
        let t0 = Instant::now();
        let mut s = Schedule::new(cfg(1, 30), t0);
        // two back-to-back runs are allowed (burst 2)
        s.request();
        assert!(s.is_due(t0));
        s.ran(t0, true);
        s.request();
        assert!(s.is_due(t0));
        s.ran(t0, true);
        // the third waits for a token: one min_interval
        s.request();
        assert!(!s.is_due(t0));
        assert_eq!(s.next_run(t0), t0 + S);
        assert!(s.is_due(t0 + S));
    }

    #[test]
    fn changes_while_rate_limited_are_batched_into_one_run() {
        let t0 = Instant::now();
        let mut s = Schedule::new(
            RunnerConfig {
                burst: 1,
                ..cfg(2, 30)
            },
            t0,
        );
        s.ran(t0, true);
        for _ in 0..10 {
            s.request();
        }
        assert!(!s.is_due(t0 + S));
        assert!(s.is_due(t0 + 2 * S));
        s.ran(t0 + 2 * S, true);
        assert!(!s.is_requested());
        assert!(!s.is_due(t0 + 3 * S));
    }

    #[test]
    fn zero_min_sync_period_never_delays() {
        let t0 = Instant::now();
        let mut s = Schedule::new(
            RunnerConfig {
                burst: 1,
                ..cfg(0, 30)
            },
            t0,
        );
        for i in 0..5 {
            s.request();
            assert!(s.is_due(t0), "run {i} delayed");
            s.ran(t0, true);
        }
    }

    #[test]
    fn failures_back_off_exponentially_up_to_sync_period() {
        let t0 = Instant::now();
        let mut s = Schedule::new(cfg(0, 10), t0);
        let mut now = t0;
        let mut delays = vec![];
        for _ in 0..6 {
            s.ran(now, false);
            let next = s.next_run(now);
            delays.push((next - now).as_secs());
            now = next;
        }
        assert_eq!(delays, vec![1, 2, 4, 8, 10, 10]);
        assert_eq!(s.failures(), 6);
        s.ran(now, true);
        assert_eq!(s.failures(), 0);
        assert_eq!(s.next_run(now), now + 10 * S);
    }

    #[test]
    fn a_retry_still_respects_the_rate_limit() {
        let t0 = Instant::now();
        let mut s = Schedule::new(
            RunnerConfig {
                burst: 1,
                retry_base: Duration::from_millis(100),
                ..cfg(2, 30)
            },
            t0,
        );
        s.ran(t0, false);
        // retry wanted at +0.1 s but no token before +2 s
        assert_eq!(s.next_run(t0), t0 + 2 * S);
    }
}
