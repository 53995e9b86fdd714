//! Sandbox networking: `egress` sandboxes get a network namespace of their
//! own, a veth pair to the host, a /30 out of a private range, NAT to the
//! host's route, DNS, and a host-side firewall; `none` sandboxes (the default)
//! get loopback only, as before.
//!
//! Why gVisor's own network stack (`--network=sandbox`) in a namespace of its
//! own: the netstack lives inside the sandbox's memory, so a checkpoint carries
//! it and a restore on another host rebuilds it from whatever namespace it is
//! given (decision 5). Host-side state, the namespace, veth, address and rules,
//! belongs to one host and one run: a checkpoint releases it, a restore sets
//! up a fresh one (runsc moves the address into netstack at start, so a
//! namespace cannot be reused anyway). `docs/decisions/0005-sandbox-networking.md`
//! records the experiments behind this.
//!
//! Parts, one job each: [`allocator`] (addresses, collision-free across
//! processes), [`netns`] (namespace and veth through `ip`), [`firewall`]
//! (NAT and filter rules through `iptables`), [`policy`] (which destinations),
//! [`dns`] (the sandbox's resolv.conf), [`conntrack`] and [`checkpoint`]
//! (making this runsc's checkpoint safe with connections around).
//!
//! Everything on the host carries a fixed prefix (`sandboxd-<slot>`
//! namespaces, `sbxd<slot>` interfaces, `SANDBOXD-` chains, `sandboxd:<slot>`
//! rule comments), so a starting server removes what a crashed one left.

pub mod allocator;
pub mod checkpoint;
mod command;
pub mod conntrack;
pub mod dns;
pub mod firewall;
pub mod netns;
pub mod policy;

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use allocator::{AddressPool, AllocatorError, LeaseOwner, Slot};
pub use command::CommandError;
pub use policy::{DestinationPolicy, Ipv4Cidr, PolicyError};

/// Default sandbox address range.
pub const DEFAULT_RANGE: &str = "10.231.0.0/16";
/// Default lease directory: shared by every server on the host.
pub const DEFAULT_LEASE_DIR: &str = "/run/sandboxd-network";

/// Whether `runsc run|restore` needs the private-`/proc/sys/net` wrapper.
///
/// runsc before 2024-07-31 (upstream 19f6b0c07) takes any namespace with
/// `/proc/sys/net/core/rmem_default` for the root network namespace and
/// refuses `--network=sandbox`; kernels 6.x have that file in every namespace.
/// The wrapper runs runsc in a private mount namespace with a tmpfs over
/// `/proc/sys/net`, which hides the file from that one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetnsWorkaround {
    /// Wrap when `runsc --version` is dated before 2024-07-31.
    Auto,
    Always,
    Never,
}

impl NetnsWorkaround {
    /// Decides for a `runsc --version` first line.
    pub fn needed(self, runsc_version: &str) -> bool {
        match self {
            Self::Always => true,
            Self::Never => false,
            Self::Auto => runsc_release_date(runsc_version).is_some_and(|date| date < 20_240_731),
        }
    }
}

/// The 8-digit date in `runsc version 0.0~20221219.0` or
/// `runsc version release-20240807.0`.
fn runsc_release_date(version: &str) -> Option<u32> {
    version
        .split(|c: char| !c.is_ascii_digit())
        .find(|digits| digits.len() == 8 && digits.starts_with("20"))
        .and_then(|digits| digits.parse().ok())
}

/// Everything egress networking needs (`docs/configuration.md`).
#[derive(Debug, Clone, PartialEq)]
pub struct NetworkConfig {
    pub range: Ipv4Cidr,
    pub allow: Vec<Ipv4Cidr>,
    pub deny: Vec<Ipv4Cidr>,
    /// Sandboxes' nameservers (DNS to them is let through).
    pub nameservers: Vec<Ipv4Addr>,
    /// Address leases; one directory for every server on the host.
    pub lease_dir: PathBuf,
    pub netns_workaround: NetnsWorkaround,
    /// How long a checkpoint may wait for closed connections to leave the
    /// sandbox's netstack before it is refused.
    pub checkpoint_wait: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error(transparent)]
    Allocator(#[from] AllocatorError),
    #[error(transparent)]
    Command(#[from] CommandError),
    #[error(transparent)]
    Conntrack(#[from] conntrack::ConntrackError),
    #[error(transparent)]
    Netns(#[from] netns::NetnsError),
    #[error("cannot enable IPv4 forwarding: {0}")]
    Forwarding(std::io::Error),
    #[error("{0}")]
    NotQuiet(String),
}

/// One sandbox's network on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxNetwork {
    pub slot: Slot,
}

impl SandboxNetwork {
    /// The namespace runsc joins.
    pub fn netns_path(&self) -> PathBuf {
        netns::netns_path(self.slot.index)
    }
}

/// This host's side of sandbox networking, shared by a runtime's sandboxes.
#[derive(Debug)]
pub struct HostNetwork {
    config: NetworkConfig,
    pool: AddressPool,
    policy: DestinationPolicy,
    wrap_runsc: bool,
}

impl HostNetwork {
    /// Checks the tools and that the checkpoint guard can read the host's
    /// connection tracking (egress is refused otherwise: the guard would be
    /// blind and a checkpoint could lose a sandbox), enables forwarding,
    /// removes what crashed servers left (their leases, namespaces, veths and
    /// rules) and installs the shared chains. `runtime` is the runtime's state directory: leases name
    /// it, so a restart in the same directory recognises its own leftovers.
    #[tracing::instrument(skip(config))]
    pub async fn start(
        config: NetworkConfig,
        runtime: &Path,
        runsc_version: &str,
    ) -> Result<Self, NetworkError> {
        let pool = AddressPool::open(
            config.range,
            config.lease_dir.clone(),
            LeaseOwner::current(runtime),
        )?;
        let policy = DestinationPolicy {
            sandbox_range: config.range,
            allow: config.allow.clone(),
            deny: config.deny.clone(),
        };
        let network = Self {
            wrap_runsc: config.netns_workaround.needed(runsc_version),
            config,
            pool,
            policy,
        };
        conntrack::check_usable().await?;
        firewall::ensure_base().await?;
        tokio::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
            .await
            .map_err(NetworkError::Forwarding)?;
        network.remove_leftovers().await?;
        tracing::info!(
            range = %network.config.range,
            wrap_runsc = network.wrap_runsc,
            "sandbox networking ready"
        );
        Ok(network)
    }

    pub fn config(&self) -> &NetworkConfig {
        &self.config
    }

    /// True when runsc must run under the `/proc/sys/net` wrapper.
    pub fn wrap_runsc(&self) -> bool {
        self.wrap_runsc
    }

    /// The sandboxes' `resolv.conf`.
    pub fn resolv_conf(&self) -> String {
        dns::resolv_conf(&self.config.nameservers)
    }

    /// Removes stale leases' resources and prefixed resources nobody leases.
    async fn remove_leftovers(&self) -> Result<(), NetworkError> {
        let stale = self.pool.stale_leases()?;
        let mut found: BTreeSet<u32> = netns::existing_slots().await?.into_iter().collect();
        found.extend(firewall::existing_slots().await?);
        let orphans = found.into_iter().filter(|slot| !self.pool.is_leased(*slot));
        let doomed: BTreeSet<u32> = stale.iter().copied().chain(orphans).collect();
        for slot in doomed {
            tracing::warn!(slot, "removing sandbox networking left by an earlier run");
            self.teardown(slot).await;
            if stale.contains(&slot) {
                self.pool.release(slot);
            }
        }
        Ok(())
    }

    async fn teardown(&self, slot: u32) {
        if let Err(err) = firewall::remove(slot).await {
            tracing::warn!(slot, %err, "could not remove sandbox firewall rules");
        }
        netns::delete(slot).await;
    }

    /// Leases an address and builds the namespace, veth and rules.
    #[tracing::instrument(skip(self))]
    pub async fn attach(&self) -> Result<SandboxNetwork, NetworkError> {
        let slot = self.pool.allocate()?;
        let built = async {
            netns::create(&slot).await?;
            firewall::install(&slot, &self.policy, &self.config.nameservers).await?;
            Ok::<(), NetworkError>(())
        }
        .await;
        match built {
            Ok(()) => Ok(SandboxNetwork { slot }),
            Err(err) => {
                self.teardown(slot.index).await;
                self.pool.release(slot.index);
                Err(err)
            }
        }
    }

    /// Removes everything of one sandbox's network and frees its address.
    #[tracing::instrument(skip(self, network), fields(slot = network.slot.index))]
    pub async fn detach(&self, network: &SandboxNetwork) {
        self.teardown(network.slot.index).await;
        self.pool.release(network.slot.index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workaround_is_for_runsc_before_the_fix() {
        assert!(NetnsWorkaround::Auto.needed("runsc version 0.0~20221219.0"));
        assert!(!NetnsWorkaround::Auto.needed("runsc version release-20240807.0"));
        assert!(!NetnsWorkaround::Auto.needed("runsc version unknown"));
        assert!(NetnsWorkaround::Always.needed("runsc version release-20250101.0"));
        assert!(!NetnsWorkaround::Never.needed("runsc version 0.0~20221219.0"));
    }
}
