//! A [`Dataplane`] that records every sync it is asked to do (tests only).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kproxy::dataplane::{CleanupError, Dataplane, ProxyMode, SyncError, SyncReport};
use kproxy::model::{ChangedSet, Snapshot};

/// One recorded `sync` call.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub snapshot: Snapshot,
    pub changed: ChangedSet,
    pub ok: bool,
    pub at: Instant,
}

/// Shared view of what a [`RecordingDataplane`] was asked to do.
#[derive(Debug, Clone, Default)]
pub struct Recorder {
    calls: Arc<Mutex<Vec<Recorded>>>,
    fail_next: Arc<AtomicUsize>,
    cleanups: Arc<AtomicUsize>,
}

impl Recorder {
    /// Every sync call so far.
    pub fn calls(&self) -> Vec<Recorded> {
        self.calls.lock().unwrap().clone()
    }
    /// Make the next `n` syncs fail.
    pub fn fail_next(&self, n: usize) {
        self.fail_next.store(n, Ordering::SeqCst);
    }
    pub fn cleanups(&self) -> usize {
        self.cleanups.load(Ordering::SeqCst)
    }
    /// Polls until `pred` holds for the calls so far or `timeout` passes; returns the calls.
    pub async fn wait_for(
        &self,
        timeout: std::time::Duration,
        what: &str,
        pred: impl Fn(&[Recorded]) -> bool,
    ) -> Vec<Recorded> {
        let deadline = Instant::now() + timeout;
        loop {
            let calls = self.calls();
            if pred(&calls) {
                return calls;
            }
            if Instant::now() > deadline {
                panic!(
                    "timed out after {timeout:?} waiting for {what}; {} syncs recorded",
                    calls.len()
                );
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
}

/// Records syncs; optionally fails some on request.
pub struct RecordingDataplane {
    rec: Recorder,
}

impl RecordingDataplane {
    pub fn new() -> (Self, Recorder) {
        let rec = Recorder::default();
        (RecordingDataplane { rec: rec.clone() }, rec)
    }
}

impl Dataplane for RecordingDataplane {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Ebpf
    }

    fn sync(&mut self, snap: &Snapshot, changed: &ChangedSet) -> Result<SyncReport, SyncError> {
        let fail = self
            .rec
            .fail_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        self.rec.calls.lock().unwrap().push(Recorded {
            snapshot: snap.clone(),
            changed: changed.clone(),
            ok: !fail,
            at: Instant::now(),
        });
        if fail {
            return Err(SyncError::Kernel("injected failure".into()));
        }
        Ok(SyncReport {
            services: snap.services.len(),
            endpoints: snap.endpoints.values().map(|e| e.len()).sum(),
            failed_services: 0,
        })
    }

    fn cleanup(&mut self) -> Result<(), CleanupError> {
        self.rec.cleanups.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}
