//! Sandbox networking: the modes a create may ask for and the egress
//! setup (address range, DNS, policy).

use std::path::PathBuf;

use clap::{Args, ValueEnum};

/// Sandbox networking (`docs/configuration.md`, "Sandbox networking").
#[derive(Debug, Clone, Args)]
pub struct NetworkArgs {
    /// Network modes a create may ask for (comma-separated: `none`, `egress`).
    /// `none` is always allowed; `egress` needs root, `ip` and `iptables`.
    #[arg(long, env = "SANDBOXD_NETWORK_MODES", default_value = "none")]
    pub network_modes: String,
    /// Private IPv4 range egress sandboxes get their addresses from (a /30 each).
    #[arg(long, env = "SANDBOXD_NETWORK_RANGE", default_value = crate::runtime::network::DEFAULT_RANGE)]
    pub network_range: String,
    /// Only these destination CIDRs (comma-separated); empty: any not denied.
    #[arg(long, env = "SANDBOXD_NETWORK_ALLOW", default_value = "")]
    pub network_allow: String,
    /// Never these destination CIDRs (comma-separated); wins over the allow
    /// list. 169.254.169.254 and the sandbox range are always denied.
    #[arg(long, env = "SANDBOXD_NETWORK_DENY", default_value = "")]
    pub network_deny: String,
    /// Sandboxes' DNS servers (comma-separated IPv4); default: the host's
    /// non-loopback `/etc/resolv.conf` nameservers.
    #[arg(long, env = "SANDBOXD_NETWORK_NAMESERVERS")]
    pub network_nameservers: Option<String>,
    /// Address leases, shared by every server on the host.
    #[arg(long, env = "SANDBOXD_NETWORK_LEASE_DIR", default_value = crate::runtime::network::DEFAULT_LEASE_DIR)]
    pub network_lease_dir: PathBuf,
    /// Run `runsc run|restore` of egress sandboxes with `/proc/sys/net`
    /// hidden (runsc before 2024-07-31 needs it on kernels 6.x); `auto`
    /// decides from `runsc --version`.
    #[arg(long, env = "SANDBOXD_RUNSC_NETNS_WORKAROUND", value_enum, default_value_t = NetnsWorkaroundArg::Auto)]
    pub runsc_netns_workaround: NetnsWorkaroundArg,
    /// Longest wait, in seconds, for an egress sandbox's closed connections
    /// to clear before a checkpoint is refused (this runsc cannot save them).
    #[arg(long, env = "SANDBOXD_NETWORK_CHECKPOINT_WAIT_S", value_parser = clap::value_parser!(u64).range(0..=3600), default_value_t = 5)]
    pub network_checkpoint_wait_s: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum NetnsWorkaroundArg {
    Auto,
    Always,
    Never,
}

impl NetworkArgs {
    /// The allowed modes, `none` always among them.
    pub fn modes(&self) -> Result<Vec<controllers::api::NetworkMode>, String> {
        let mut modes = vec![controllers::api::NetworkMode::None];
        for name in self.network_modes.split(',').map(str::trim) {
            if name.is_empty() {
                continue;
            }
            let mode = name
                .parse()
                .map_err(|err| format!("SANDBOXD_NETWORK_MODES: {err}"))?;
            if !modes.contains(&mode) {
                modes.push(mode);
            }
        }
        Ok(modes)
    }

    /// The runtime's networking when `egress` is allowed, else `None`.
    pub fn config(&self) -> Result<Option<crate::runtime::NetworkConfig>, String> {
        use crate::runtime::network::{dns, policy::parse_cidr_list};
        if !self
            .modes()?
            .contains(&controllers::api::NetworkMode::Egress)
        {
            return Ok(None);
        }
        let range = self
            .network_range
            .parse()
            .map_err(|err| format!("SANDBOXD_NETWORK_RANGE: {err}"))?;
        let allow = parse_cidr_list(&self.network_allow)
            .map_err(|err| format!("SANDBOXD_NETWORK_ALLOW: {err}"))?;
        let deny = parse_cidr_list(&self.network_deny)
            .map_err(|err| format!("SANDBOXD_NETWORK_DENY: {err}"))?;
        let nameservers = match &self.network_nameservers {
            None => dns::host_nameservers(),
            Some(list) => list
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| {
                    s.parse().map_err(|_| {
                        format!("SANDBOXD_NETWORK_NAMESERVERS: {s:?} is not an IPv4 address")
                    })
                })
                .collect::<Result<_, _>>()?,
        };
        Ok(Some(crate::runtime::NetworkConfig {
            range,
            allow,
            deny,
            nameservers,
            lease_dir: self.network_lease_dir.clone(),
            netns_workaround: match self.runsc_netns_workaround {
                NetnsWorkaroundArg::Auto => crate::runtime::NetnsWorkaround::Auto,
                NetnsWorkaroundArg::Always => crate::runtime::NetnsWorkaround::Always,
                NetnsWorkaroundArg::Never => crate::runtime::NetnsWorkaround::Never,
            },
            checkpoint_wait: std::time::Duration::from_secs(self.network_checkpoint_wait_s),
        }))
    }
}
