//! The warm pool: sandboxes booted ahead of demand, so a create takes one
//! (a few milliseconds) instead of waiting for runsc's cold boot and the
//! agent's first handshake (about 200 ms here).
//!
//! A warm sandbox is a container started exactly as a create starts one (same
//! bundle, same image, agent handshake done) that no user code has touched.
//! It has a container id like every other (`sbx` + its runtime's owner tag + a fresh suffix, see `owner.rs`), and
//! no sandbox id: the sandbox id, and so everything in the bucket, is only
//! chosen by the create that takes it. Nothing in the container knows its
//! sandbox id or when it booted, so a taken sandbox is a cold one: its Python
//! session starts at its first cell, `/tmp` is empty, its checkpoints record
//! the same fields (image digest, network, runsc version, CPU features, agent
//! version).
//!
//! **Key.** What shapes the booted container: the image's digest and the
//! network mode. Limits, mounts and the agent are the server's, the same for
//! every sandbox, so the bundle is a function of those two. The pool holds
//! sandboxes of the default image (as it resolves at refill time) with
//! network `none`; `egress` sandboxes are never pooled (each has a network
//! namespace, address and firewall rules of its own, set up at create), and
//! a create asking for another image or `egress` boots cold. A create from a
//! filesystem snapshot whose image is the default takes one and unpacks the
//! snapshot into it, as a cold one does.
//!
//! **Refill.** One task, one boot at a time, started again whenever a take
//! or a shrink leaves the pool short. The container's CPU weight is lowered
//! to an eighth of the default from the moment runsc makes its cgroup until
//! a create takes it (`runtime::cgroup`), so the boot yields the CPU to
//! running sandboxes. A failed boot is retried with back-off (0.5 s to
//! 30 s).
//!
//! **Capacity.** [`GvisorRuntime::warm_pool`] reports what the pool holds
//! and the memory it uses (the containers' memory cgroups), and
//! [`GvisorRuntime::resize_warm_pool`] shrinks it (the extra sandboxes are
//! destroyed at once): admission counts the pool and shrinks it first under
//! memory pressure.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use controllers::api::{NetworkMode, SandboxId};
use controllers::runtime::{CreateOptions, RuntimeError, WarmPoolStats};

use super::GvisorRuntime;
use super::local::{Ahead, Local};
use crate::runtime::agent::AgentConnection;
use crate::runtime::cgroup::{self, LoweredWeight, WeightWatch};
use crate::runtime::checkpoint::cpu_quota::CGROUP_ROOT;
use crate::runtime::images::catalog::Image;
use crate::runtime::images::ready::read_ready_command;

/// How long a container booted for a create waits for it (its pass comes
/// within milliseconds of the create's writes; this only bounds a leak).
const PREPARED_FOR: Duration = Duration::from_secs(60);

/// Back-off after a failed boot, doubling up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// A booted, untouched sandbox waiting for a create.
#[derive(Debug)]
pub(super) struct WarmSandbox {
    pub(super) container_id: String,
    pub(super) dir: PathBuf,
    pub(super) agent: Arc<AgentConnection>,
    pub(super) image: Image,
    booted_at: Instant,
    /// Its CPU weight while it waits; put back when taken.
    weight: Option<LoweredWeight>,
}

impl WarmSandbox {
    /// Whether a create with this image and network may take it.
    fn fits(&self, image: &Image, network: NetworkMode) -> bool {
        network == NetworkMode::None && self.image.digest == image.digest
    }

    /// The sandbox now belongs to a create: it competes for the CPU like any.
    pub(super) fn into_taken(mut self) -> (String, PathBuf, Arc<AgentConnection>, Image) {
        if let Some(weight) = self.weight.take() {
            weight.restore();
        }
        (self.container_id, self.dir, self.agent, self.image)
    }
}

/// The pool's state, shared by the runtime and its refill task.
#[derive(Debug, Default)]
pub(super) struct WarmPool {
    target: AtomicUsize,
    ready: Mutex<Vec<WarmSandbox>>,
    wake: tokio::sync::Notify,
    closed: AtomicBool,
    hits: AtomicU64,
    misses: AtomicU64,
    boots: AtomicU64,
    boot_failures: AtomicU64,
    refill: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl WarmPool {
    fn ready(&self) -> std::sync::MutexGuard<'_, Vec<WarmSandbox>> {
        self.ready.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn short(&self) -> bool {
        !self.closed.load(Ordering::Acquire)
            && self.ready().len() < self.target.load(Ordering::Acquire)
    }
}

impl GvisorRuntime {
    /// Starts keeping `size` warm sandboxes of the default image (network
    /// `none`); 0 keeps none. Call once, on the runtime the server uses.
    pub fn start_warm_pool(self: &Arc<Self>, size: usize) {
        let pool = Arc::clone(&self.pool);
        pool.target.store(size, Ordering::Release);
        if size == 0 {
            return;
        }
        let task = tokio::spawn(refill(Arc::clone(&pool), Arc::downgrade(self)));
        if let Some(previous) = pool
            .refill
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(task)
        {
            previous.abort();
        }
        pool.wake.notify_one();
    }

    /// What the warm pool holds and has done.
    pub fn warm_pool(&self) -> WarmPoolStats {
        let pool = &self.pool;
        let (ready, memory_bytes) = {
            let ready = pool.ready();
            let memory = ready
                .iter()
                .filter_map(|warm| {
                    cgroup::memory_bytes(std::path::Path::new(CGROUP_ROOT), &warm.container_id)
                })
                .sum();
            (ready.len(), memory)
        };
        WarmPoolStats {
            target: pool.target.load(Ordering::Acquire),
            ready,
            memory_bytes,
            hits: pool.hits.load(Ordering::Relaxed),
            misses: pool.misses.load(Ordering::Relaxed),
            boots: pool.boots.load(Ordering::Relaxed),
            boot_failures: pool.boot_failures.load(Ordering::Relaxed),
        }
    }

    /// Keeps at most `size` warm sandboxes from now on: the extra ones are
    /// destroyed now (memory pressure shrinks the pool before anything
    /// else). Growing it again refills in the background.
    pub fn resize_warm_pool(&self, size: usize) {
        self.pool.target.store(size, Ordering::Release);
        let extra: Vec<WarmSandbox> = {
            let mut ready = self.pool.ready();
            let keep = ready.len().min(size);
            ready.drain(keep..).collect()
        };
        for warm in extra {
            self.discard_warm(warm);
        }
        self.pool.wake.notify_one();
    }

    /// Takes a warm sandbox a create of `image` with `network` may use.
    /// Counts a miss for a create the pool is meant for that found none.
    pub(super) fn take_warm(&self, image: &Image, network: NetworkMode) -> Option<WarmSandbox> {
        let pool = &self.pool;
        if pool.target.load(Ordering::Acquire) == 0 || network != NetworkMode::None {
            return None;
        }
        let (taken, stale) = {
            let mut ready = pool.ready();
            // A warm sandbox whose agent died is of no use to anyone.
            let (alive, dead): (Vec<_>, Vec<_>) =
                ready.drain(..).partition(|warm| !warm.agent.is_gone());
            *ready = alive;
            let taken = ready
                .iter()
                .position(|warm| warm.fits(image, network))
                .map(|at| ready.remove(at));
            (taken, dead)
        };
        for warm in stale {
            tracing::warn!(container = %warm.container_id, "a warm sandbox died while it waited");
            self.discard_warm(warm);
        }
        match &taken {
            Some(warm) => {
                pool.hits.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(container = %warm.container_id, waited_ms = warm.booted_at.elapsed().as_millis() as u64, "took a warm sandbox");
            }
            None => {
                if self
                    .config
                    .images
                    .default_image()
                    .is_ok_and(|default| default.digest == image.digest)
                {
                    pool.misses.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        pool.wake.notify_one();
        taken
    }

    pub(super) fn discard_warm(&self, warm: WarmSandbox) {
        self.delete_in_background(warm.container_id, warm.dir);
    }

    /// Stops the refill (waiting for a boot in progress) and destroys every
    /// warm sandbox: for shutdown.
    pub(super) async fn close_warm_pool(&self) {
        self.pool.closed.store(true, Ordering::Release);
        self.pool.wake.notify_one();
        let task = self
            .pool
            .refill
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(task) = task {
            let _ = task.await;
        }
        let ready: Vec<WarmSandbox> = self.pool.ready().drain(..).collect();
        let prepared = self.take_prepared_where(|_| true);
        for warm in ready.into_iter().chain(prepared) {
            self.discard_warm(warm);
        }
    }

    /// Boots one warm sandbox of the default image, at a low CPU weight.
    async fn boot_warm(&self) -> Result<WarmSandbox, RuntimeError> {
        let image = self
            .config
            .images
            .default_image()
            .map_err(|err| RuntimeError::Failed(format!("the default sandbox image: {err}")))?;
        let (container_id, dir) = self.new_container(None, &image)?;
        let watch = WeightWatch::start(PathBuf::from(CGROUP_ROOT), container_id.clone());
        let launched = self
            .launch(&"(warm pool)", &container_id, &dir, None, None)
            .await;
        let weight = watch.end().await;
        let agent = launched?;
        if weight.is_none() {
            tracing::debug!(container = %container_id, "a warm sandbox runs at normal CPU weight (no writable cgroup)");
        }
        Ok(WarmSandbox {
            container_id,
            dir,
            agent,
            image,
            #[allow(
                clippy::disallowed_methods,
                reason = "the age of a booted runsc container on this host (logged; a prepared one expires); no simulation runs runsc"
            )]
            booted_at: Instant::now(),
            weight,
        })
    }

    /// Boots `sandbox`'s container while its create is being recorded
    /// (decision 23), at normal CPU weight: the create waits for it. Only a
    /// create a warm sandbox would serve (network `none`, no ready
    /// command, no snapshot) and the pool cannot serve now is prepared.
    pub(super) async fn prepare_boot(
        &self,
        sandbox: &SandboxId,
        options: &CreateOptions,
    ) -> Result<(), RuntimeError> {
        if options.network != NetworkMode::None || options.snapshot_name.is_some() {
            return Ok(());
        }
        let image = self
            .image_for_create(options.image.as_deref(), None)
            .await?;
        if !matches!(read_ready_command(&image.rootfs), Ok(None)) {
            return Ok(());
        }
        let pool_serves = self.pool.target.load(Ordering::Acquire) > 0
            && self
                .pool
                .ready()
                .iter()
                .any(|warm| warm.fits(&image, options.network) && !warm.agent.is_gone());
        if pool_serves {
            return Ok(());
        }
        self.forget_stale_prepared();
        let (container_id, dir) = self.new_container(None, &image)?;
        let agent = self
            .launch(sandbox, &container_id, &dir, None, None)
            .await?;
        let booted = WarmSandbox {
            container_id,
            dir,
            agent,
            image,
            #[allow(
                clippy::disallowed_methods,
                reason = "the age of a booted runsc container on this host (logged; a prepared one expires); no simulation runs runsc"
            )]
            booted_at: Instant::now(),
            weight: None,
        };
        let discarded = self
            .locals
            .step(sandbox, |state| Local::prepare(state, booted));
        if let Some(discarded) = discarded {
            self.discard_warm(discarded);
        }
        Ok(())
    }

    /// The container [`Self::prepare_boot`] booted for `sandbox`, if it
    /// fits `image` and is alive (else it is discarded).
    pub(super) fn take_prepared(&self, sandbox: &SandboxId, image: &Image) -> Option<WarmSandbox> {
        let prepared = self.locals.step(sandbox, Local::take_prepared)?;
        if prepared.fits(image, NetworkMode::None) && !prepared.agent.is_gone() {
            tracing::debug!(%sandbox, container = %prepared.container_id, waited_ms = prepared.booted_at.elapsed().as_millis() as u64, "took the container booted beside the create's writes");
            return Some(prepared);
        }
        self.discard_warm(prepared);
        None
    }

    /// The create `sandbox`'s boot was prepared for will not come.
    pub(super) fn forget_prepared(&self, sandbox: &SandboxId) {
        let prepared = self.locals.step(sandbox, Local::forget_prepared);
        if let Some(prepared) = prepared {
            self.discard_warm(prepared);
        }
    }

    /// Discards prepared containers no create took within
    /// [`PREPARED_FOR`] (a create whose pass never came).
    fn forget_stale_prepared(&self) {
        let stale = self.take_prepared_where(|booted| booted.booted_at.elapsed() > PREPARED_FOR);
        for booted in stale {
            tracing::warn!(container = %booted.container_id, "no create took a prepared container; discarding it");
            self.discard_warm(booted);
        }
    }

    /// Takes every container booted for a create (waiting for it, or for
    /// its reservation to take it) that `pick` picks, out of its sandbox's
    /// state.
    fn take_prepared_where(&self, pick: impl Fn(&WarmSandbox) -> bool) -> Vec<WarmSandbox> {
        let mut locals = self.locals.all();
        let picked: Vec<SandboxId> = locals
            .iter()
            .filter(|(_, local)| match local {
                Local::Prepared(booted)
                | Local::Reserved {
                    ahead: Some(Ahead::Prepared(booted)),
                    ..
                } => pick(booted),
                _ => false,
            })
            .map(|(sandbox, _)| sandbox.clone())
            .collect();
        let mut taken = Vec::new();
        for sandbox in picked {
            let Some(state) = locals.remove(&sandbox) else {
                continue;
            };
            let (next, booted) = Local::forget_prepared(Some(state));
            if let Some(next) = next {
                locals.insert(sandbox, next);
            }
            taken.extend(booted);
        }
        taken
    }

    /// Adds a booted sandbox unless the pool closed or shrank meanwhile.
    fn add_warm(&self, warm: WarmSandbox) {
        let pool = &self.pool;
        let refused = {
            let mut ready = pool.ready();
            // Sandboxes of a default image that was renamed since are stale.
            let stale: Vec<WarmSandbox> = {
                let (fresh, stale): (Vec<_>, Vec<_>) = ready
                    .drain(..)
                    .partition(|old| old.image.digest == warm.image.digest);
                *ready = fresh;
                stale
            };
            let refused = if pool.closed.load(Ordering::Acquire)
                || ready.len() >= pool.target.load(Ordering::Acquire)
            {
                Some(warm)
            } else {
                ready.push(warm);
                None
            };
            (stale, refused)
        };
        for warm in refused.0.into_iter().chain(refused.1) {
            self.discard_warm(warm);
        }
    }
}

/// The refill task: one boot at a time while the pool is short.
async fn refill(pool: Arc<WarmPool>, runtime: Weak<GvisorRuntime>) {
    let mut backoff = FIRST_BACKOFF;
    loop {
        if pool.closed.load(Ordering::Acquire) {
            return;
        }
        if !pool.short() {
            pool.wake.notified().await;
            continue;
        }
        let Some(runtime) = runtime.upgrade() else {
            return;
        };
        #[allow(
            clippy::disallowed_methods,
            reason = "times work on the host (runsc, processes, files) for a log line; not the instance's clock"
        )]
        let started = Instant::now();
        match runtime.boot_warm().await {
            Ok(warm) => {
                backoff = FIRST_BACKOFF;
                pool.boots.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(container = %warm.container_id, boot_ms = started.elapsed().as_millis() as u64, "warm sandbox ready");
                runtime.add_warm(warm);
            }
            Err(err) => {
                pool.boot_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%err, retry_in = ?backoff, "cannot boot a warm sandbox");
                drop(runtime);
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = pool.wake.notified() => {}
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}
