//! A sandbox's network namespace and veth pair, made and removed with `ip`.
//!
//! Names carry fixed prefixes so startup can find whatever a crashed server
//! left: namespace `sandboxd-<slot>` (under `/var/run/netns`, where runsc
//! joins it through the bundle), host interface `sbxd<slot>` (at most 11
//! characters: interface names stop at 15). Inside, the peer is `eth0` with
//! the slot's sandbox address and a default route through the host side.
//! runsc moves the address and routes into gVisor's netstack at start, so a
//! namespace serves one run only: a restore gets a fresh one.

use std::path::{Path, PathBuf};

use super::allocator::{SLOT_PREFIX, Slot};
use super::command::{CommandError, run};

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error(transparent)]
    Command(#[from] CommandError),
    #[error(
        "cannot turn IPv6 off on {interface} ({source}); without that the sandbox could reach \
         host services over link-local IPv6, which the IPv4 firewall does not see"
    )]
    Ipv6Off {
        interface: String,
        source: std::io::Error,
    },
}

/// Prefix of every namespace this server creates.
pub const NETNS_PREFIX: &str = "sandboxd-";
/// Prefix of every host-side interface this server creates (also used as an
/// iptables interface wildcard: `sbxd+`).
pub const VETH_PREFIX: &str = "sbxd";

pub fn netns_name(slot: u32) -> String {
    format!("{NETNS_PREFIX}{slot}")
}

pub fn veth_name(slot: u32) -> String {
    format!("{VETH_PREFIX}{slot}")
}

/// Where runsc finds the namespace.
pub fn netns_path(slot: u32) -> PathBuf {
    PathBuf::from("/var/run/netns").join(netns_name(slot))
}

async fn ip(args: &[&str]) -> Result<(), CommandError> {
    run("ip", args, None).await.map(drop)
}

/// Creates the namespace, the veth pair, addresses and the default route.
/// On failure whatever was made is removed again.
pub async fn create(slot: &Slot) -> Result<(), NetnsError> {
    let made = create_steps(slot).await;
    if made.is_err() {
        delete(slot.index).await;
    }
    made
}

async fn create_steps(slot: &Slot) -> Result<(), NetnsError> {
    let netns = netns_name(slot.index);
    let veth = veth_name(slot.index);
    let host = format!("{}/{SLOT_PREFIX}", slot.host);
    let sandbox = format!("{}/{SLOT_PREFIX}", slot.sandbox);
    let gateway = slot.host.to_string();
    ip(&["netns", "add", &netns]).await?;
    ip(&[
        "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &netns,
    ])
    .await?;
    disable_ipv6(&veth).await?;
    ip(&["addr", "add", &host, "dev", &veth]).await?;
    ip(&["link", "set", &veth, "up"]).await?;
    ip(&["-n", &netns, "addr", "add", &sandbox, "dev", "eth0"]).await?;
    ip(&["-n", &netns, "link", "set", "lo", "up"]).await?;
    ip(&["-n", &netns, "link", "set", "eth0", "up"]).await?;
    ip(&["-n", &netns, "route", "add", "default", "via", &gateway]).await?;
    Ok(())
}

/// No IPv6 on the host side (before the link is up, so it never gets a
/// link-local address): the sandbox must not reach host services over
/// link-local IPv6, which the IPv4 firewall does not see. Fails closed; only
/// a kernel without IPv6 at all (no `/proc/sys/net/ipv6`) needs nothing.
async fn disable_ipv6(veth: &str) -> Result<(), NetnsError> {
    let setting = format!("/proc/sys/net/ipv6/conf/{veth}/disable_ipv6");
    match tokio::fs::write(&setting, "1").await {
        Ok(()) => Ok(()),
        Err(_)
            if !tokio::fs::try_exists(Path::new("/proc/sys/net/ipv6"))
                .await
                .unwrap_or(true) =>
        {
            Ok(())
        }
        Err(source) => Err(NetnsError::Ipv6Off {
            interface: veth.to_owned(),
            source,
        }),
    }
}

/// Removes the namespace and the host interface (each if present).
pub async fn delete(slot: u32) {
    // Deleting the namespace destroys its end of the pair, and with it the
    // host end; the explicit link delete covers a namespace already gone.
    if let Err(err) = ip(&["netns", "delete", &netns_name(slot)]).await
        && !err.stderr().contains("No such file")
    {
        tracing::warn!(slot, %err, "could not delete a sandbox network namespace");
    }
    if let Err(err) = ip(&["link", "delete", &veth_name(slot)]).await
        && !err.stderr().contains("Cannot find device")
    {
        tracing::warn!(slot, %err, "could not delete a sandbox veth");
    }
}

/// Slots of every namespace and host interface with our prefixes.
pub async fn existing_slots() -> Result<Vec<u32>, CommandError> {
    let mut slots = Vec::new();
    let namespaces = run("ip", &["netns", "list"], None).await?;
    for line in namespaces.lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        if let Some(slot) = name.strip_prefix(NETNS_PREFIX).and_then(|n| n.parse().ok()) {
            slots.push(slot);
        }
    }
    let links = run("ip", &["-o", "link", "show"], None).await?;
    for line in links.lines() {
        // `12: sbxd3@if2: <BROADCAST,…`
        let name = line.split(':').nth(1).unwrap_or_default().trim();
        let name = name.split('@').next().unwrap_or_default();
        if let Some(slot) = name.strip_prefix(VETH_PREFIX).and_then(|n| n.parse().ok()) {
            slots.push(slot);
        }
    }
    slots.sort_unstable();
    slots.dedup();
    Ok(slots)
}
