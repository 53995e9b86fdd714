//! The host's packet filter for sandboxes, through `iptables` (nf_tables or
//! legacy backend, whichever `iptables` is).
//!
//! Shared chains, created once per host and jumped to first from the built-in
//! ones: `SANDBOXD-FORWARD` (FORWARD), `SANDBOXD-INPUT` (INPUT) and, in the nat
//! table, `SANDBOXD-POSTROUTING` (POSTROUTING). Each sandbox then gets chains
//! of its own, `SANDBOXD-<slot>-EGRESS` (its packets leaving through the host),
//! `SANDBOXD-<slot>-REPLY` (packets to it: replies only) and
//! `SANDBOXD-<slot>-HOST` (its packets to the host itself: dropped but DNS), a
//! MASQUERADE rule, and jumps keyed on its veth. Every per-sandbox rule in a
//! shared chain carries the comment `sandboxd:<slot>`, so removal (destroy, or
//! startup after a crash) finds them in `iptables-save` without knowing the
//! configuration they were made with.
//!
//! The policy runs in `FORWARD`, after the host's own `PREROUTING` DNAT
//! (Docker's published ports, Kubernetes services) has rewritten the
//! destination, so the egress chain drops every connection whose destination
//! was rewritten (`--ctstate DNAT`), DNS addressed to a nameserver excepted.
//!
//! Two connmark bits record how each TCP connection closed, for the checkpoint
//! guard ([`super::conntrack`]): [`PEER_FIN_MARK`] once the peer sent a FIN,
//! [`SANDBOX_FIRST_FIN_MARK`] when the sandbox sent its FIN before the peer
//! did (only then does the sandbox's netstack keep a TIME_WAIT endpoint).

use std::net::Ipv4Addr;

use super::allocator::Slot;
use super::command::{CommandError, XTABLES_WAIT, run};
use super::netns::{VETH_PREFIX, veth_name};
use super::policy::{DestinationPolicy, Verdict};

pub const FORWARD_CHAIN: &str = "SANDBOXD-FORWARD";
pub const INPUT_CHAIN: &str = "SANDBOXD-INPUT";
pub const NAT_CHAIN: &str = "SANDBOXD-POSTROUTING";
/// Prefix of every chain this server creates.
pub const CHAIN_PREFIX: &str = "SANDBOXD-";
/// Connmark bit: the peer has sent a FIN.
pub const PEER_FIN_MARK: u32 = 0x0010_0000;
/// Connmark bit: the sandbox sent a FIN before the peer did.
pub const SANDBOX_FIRST_FIN_MARK: u32 = 0x0020_0000;
const QUIESCE_COMMENT: &str = "sandboxd:quiesce";

fn comment(slot: u32) -> String {
    format!("sandboxd:{slot}")
}

fn chain(slot: u32, role: &str) -> String {
    format!("{CHAIN_PREFIX}{slot}-{role}")
}

async fn iptables(args: &[&str]) -> Result<String, CommandError> {
    let mut full = vec![XTABLES_WAIT];
    full.extend_from_slice(args);
    run("iptables", &full, None).await
}

/// Creates the shared chains and their jumps if missing. Idempotent; safe
/// while other servers on the host do the same.
pub async fn ensure_base() -> Result<(), CommandError> {
    for (table, chain, parent) in [
        ("filter", FORWARD_CHAIN, "FORWARD"),
        ("filter", INPUT_CHAIN, "INPUT"),
        ("nat", NAT_CHAIN, "POSTROUTING"),
    ] {
        if let Err(err) = iptables(&["-t", table, "-N", chain]).await
            && !err.stderr().contains("exists")
        {
            return Err(err);
        }
        if iptables(&["-t", table, "-C", parent, "-j", chain])
            .await
            .is_err()
        {
            iptables(&["-t", table, "-I", parent, "1", "-j", chain]).await?;
        }
    }
    Ok(())
}

/// The `iptables-restore --noflush` input that gives one sandbox its rules.
pub fn sandbox_rules(slot: &Slot, policy: &DestinationPolicy, nameservers: &[Ipv4Addr]) -> String {
    let index = slot.index;
    let veth = veth_name(index);
    let tag = comment(index);
    let (egress, reply, host) = (
        chain(index, "EGRESS"),
        chain(index, "REPLY"),
        chain(index, "HOST"),
    );
    let mut out = String::from("*filter\n");
    for name in [&egress, &reply, &host] {
        out.push_str(&format!(":{name} - [0:0]\n"));
    }
    // Only its own source address leaves (no spoofing another sandbox).
    out.push_str(&format!(
        "-A {egress} ! -s {}/32 -j DROP\n-A {host} ! -s {}/32 -j DROP\n",
        slot.sandbox, slot.sandbox
    ));
    out.push_str(&format!(
        "-A {egress} -p tcp --tcp-flags FIN FIN -m connmark ! --mark {PEER_FIN_MARK:#x}/{PEER_FIN_MARK:#x} -j CONNMARK --or-mark {SANDBOX_FIRST_FIN_MARK:#x}\n"
    ));
    for server in nameservers {
        for protocol in ["udp", "tcp"] {
            // Addressed to the nameserver, whether or not the host's own NAT
            // then sends it elsewhere (a Kubernetes DNS service address).
            let rules = [
                format!("-d {server}/32 -p {protocol} --dport 53 -j ACCEPT"),
                format!(
                    "-p {protocol} -m conntrack --ctstate DNAT --ctorigdst {server}/32 --ctorigdstport 53 -j ACCEPT"
                ),
            ];
            for rule in rules {
                out.push_str(&format!("-A {egress} {rule}\n-A {host} {rule}\n"));
            }
        }
    }
    // Anything else the host's NAT redirected (a Docker published port, a
    // Kubernetes NodePort or service address) is dropped: the policy below
    // would judge the rewritten destination, not the one the sandbox chose,
    // and the host's own services would be reached through their DNAT.
    out.push_str(&format!(
        "-A {egress} -m conntrack --ctstate DNAT -j DROP\n"
    ));
    let (rules, fallback) = policy.rules();
    let target = |verdict| match verdict {
        Verdict::Accept => "ACCEPT",
        Verdict::Drop => "DROP",
    };
    for (cidr, verdict) in rules {
        out.push_str(&format!("-A {egress} -d {cidr} -j {}\n", target(verdict)));
    }
    out.push_str(&format!("-A {egress} -j {}\n", target(fallback)));
    out.push_str(&format!(
        "-A {reply} -p tcp --tcp-flags FIN FIN -j CONNMARK --or-mark {PEER_FIN_MARK:#x}\n\
         -A {reply} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n\
         -A {reply} -j DROP\n\
         -A {host} -j DROP\n"
    ));
    out.push_str(&format!(
        "-A {FORWARD_CHAIN} -i {veth} -m comment --comment {tag} -j {egress}\n\
         -A {FORWARD_CHAIN} -o {veth} -m comment --comment {tag} -j {reply}\n\
         -A {INPUT_CHAIN} -i {veth} -m comment --comment {tag} -j {host}\n\
         COMMIT\n*nat\n\
         -A {NAT_CHAIN} -s {}/32 -m comment --comment {tag} -j MASQUERADE\n\
         COMMIT\n",
        slot.sandbox
    ));
    out
}

/// Installs one sandbox's rules in one transaction.
pub async fn install(
    slot: &Slot,
    policy: &DestinationPolicy,
    nameservers: &[Ipv4Addr],
) -> Result<(), CommandError> {
    let rules = sandbox_rules(slot, policy, nameservers);
    run(
        "iptables-restore",
        &[XTABLES_WAIT, "--noflush"],
        Some(&rules),
    )
    .await
    .map(drop)
}

/// The `iptables-restore --noflush` input of [`quiesce`]: rules inserted
/// first in the sandbox's chains, in one transaction.
pub fn quiesce_rules(slot: u32) -> String {
    let (egress, reply) = (chain(slot, "EGRESS"), chain(slot, "REPLY"));
    let tag = format!("-m comment --comment {QUIESCE_COMMENT}");
    format!(
        "*filter\n\
         -I {egress} 1 {tag} -j DROP\n\
         -I {egress} 1 -p tcp {tag} -j REJECT --reject-with tcp-reset\n\
         -I {reply} 1 {tag} -j DROP\n\
         COMMIT\n"
    )
}

/// Blocks the sandbox's traffic for a checkpoint: its TCP segments are
/// answered with a RST (a connection its process closes now ends at once,
/// without a TIME_WAIT, and no new one can open), anything else and every
/// packet towards it is dropped. All or nothing: one `iptables-restore`
/// transaction, so a failure leaves no half of it behind.
pub async fn quiesce(slot: u32) -> Result<(), CommandError> {
    run(
        "iptables-restore",
        &[XTABLES_WAIT, "--noflush"],
        Some(&quiesce_rules(slot)),
    )
    .await
    .map(drop)
}

/// Undoes [`quiesce`] (the checkpoint was refused; the sandbox goes on).
pub async fn unquiesce(slot: u32) -> Result<(), CommandError> {
    let (egress, reply) = (chain(slot, "EGRESS"), chain(slot, "REPLY"));
    let saved = iptables_save("filter").await?;
    for line in saved.lines() {
        let ours = line.contains(QUIESCE_COMMENT)
            && (line.starts_with(&format!("-A {egress} "))
                || line.starts_with(&format!("-A {reply} ")));
        if ours {
            delete_rule("filter", line).await;
        }
    }
    Ok(())
}

async fn iptables_save(table: &str) -> Result<String, CommandError> {
    run("iptables-save", &["-t", table], None).await
}

/// Deletes the rule an `iptables-save` line (`-A CHAIN …`) describes.
async fn delete_rule(table: &str, line: &str) {
    let Some(spec) = line.strip_prefix("-A ") else {
        return;
    };
    let mut args = vec!["-t".to_owned(), table.to_owned(), "-D".to_owned()];
    args.extend(
        spec.split_whitespace()
            .map(|word| word.trim_matches('"').to_owned()),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    if let Err(err) = iptables(&args).await {
        // Another server may have removed it first.
        tracing::debug!(%err, "iptables rule already gone");
    }
}

/// The slot a saved rule or chain belongs to, if it is one of ours.
fn slot_of(line: &str) -> Option<u32> {
    if let Some(start) = line.find("sandboxd:") {
        let digits: String = line[start + "sandboxd:".len()..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        if let Ok(slot) = digits.parse() {
            return Some(slot);
        }
    }
    let name = line.strip_prefix(':')?.split_whitespace().next()?;
    let (slot, _) = name.strip_prefix(CHAIN_PREFIX)?.split_once('-')?;
    slot.parse().ok()
}

/// Every slot with rules or chains in the tables.
pub async fn existing_slots() -> Result<Vec<u32>, CommandError> {
    let mut slots = Vec::new();
    for table in ["filter", "nat"] {
        slots.extend(iptables_save(table).await?.lines().filter_map(slot_of));
    }
    slots.sort_unstable();
    slots.dedup();
    Ok(slots)
}

/// Removes everything of one sandbox: jumps, NAT rule, its chains.
pub async fn remove(slot: u32) -> Result<(), CommandError> {
    for table in ["filter", "nat"] {
        let saved = iptables_save(table).await?;
        for line in saved.lines() {
            if line.starts_with("-A ") && line.contains(&format!("\"{}\"", comment(slot)))
                || line.starts_with("-A ")
                    && line.contains(&format!("--comment {} ", comment(slot)))
            {
                delete_rule(table, line).await;
            }
        }
        for role in ["EGRESS", "REPLY", "HOST"] {
            let name = chain(slot, role);
            if saved
                .lines()
                .any(|line| line.starts_with(&format!(":{name} ")))
            {
                let _ = iptables(&["-t", table, "-F", &name]).await;
                if let Err(err) = iptables(&["-t", table, "-X", &name]).await {
                    tracing::warn!(slot, %err, "could not delete a sandbox chain");
                }
            }
        }
    }
    Ok(())
}

/// The interface wildcard matching every sandbox veth.
pub fn veth_wildcard() -> String {
    format!("{VETH_PREFIX}+")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_follow_the_policy_order_and_carry_the_slot_comment() {
        let slot = Slot {
            index: 7,
            host: Ipv4Addr::new(10, 231, 0, 29),
            sandbox: Ipv4Addr::new(10, 231, 0, 30),
        };
        let policy = DestinationPolicy {
            sandbox_range: "10.231.0.0/16".parse().expect("cidr"),
            allow: vec![],
            deny: vec!["203.0.113.0/24".parse().expect("cidr")],
        };
        let rules = sandbox_rules(&slot, &policy, &[Ipv4Addr::new(169, 254, 169, 254)]);
        let position = |needle: &str| {
            rules
                .find(needle)
                .unwrap_or_else(|| panic!("{needle} in {rules}"))
        };
        assert!(position("--dport 53 -j ACCEPT") < position("-d 169.254.0.0/16 -j DROP"));
        assert!(
            position("--ctorigdst 169.254.169.254/32 --ctorigdstport 53 -j ACCEPT")
                < position("-A SANDBOXD-7-EGRESS -m conntrack --ctstate DNAT -j DROP")
        );
        assert!(
            position("-A SANDBOXD-7-EGRESS -m conntrack --ctstate DNAT -j DROP")
                < position("-d 169.254.0.0/16 -j DROP")
        );
        assert!(position("-d 169.254.0.0/16 -j DROP") < position("-d 203.0.113.0/24 -j DROP"));
        assert!(position("-d 203.0.113.0/24 -j DROP") < position("-A SANDBOXD-7-EGRESS -j ACCEPT"));
        // Private ranges are closed by default, after the deny list.
        assert!(position("-d 203.0.113.0/24 -j DROP") < position("-d 10.0.0.0/8 -j DROP"));
        assert!(position("-d 100.64.0.0/10 -j DROP") < position("-A SANDBOXD-7-EGRESS -j ACCEPT"));
        assert!(rules.contains(
            "-A SANDBOXD-FORWARD -i sbxd7 -m comment --comment sandboxd:7 -j SANDBOXD-7-EGRESS"
        ));
        assert!(rules.contains("-A SANDBOXD-POSTROUTING -s 10.231.0.30/32 -m comment --comment sandboxd:7 -j MASQUERADE"));
        assert!(rules.contains("-A SANDBOXD-7-HOST -j DROP"));
        assert!(
            position("-A SANDBOXD-7-EGRESS ! -s 10.231.0.30/32 -j DROP")
                < position("--dport 53 -j ACCEPT")
        );
    }

    #[test]
    fn quiesce_is_one_transaction_resetting_tcp_before_dropping() {
        let rules = quiesce_rules(4);
        let lines: Vec<&str> = rules.lines().collect();
        assert_eq!(lines.first(), Some(&"*filter"));
        assert_eq!(lines.last(), Some(&"COMMIT"));
        // Inserted at 1 in turn: the reset ends up above the drop.
        assert_eq!(
            lines[1],
            "-I SANDBOXD-4-EGRESS 1 -m comment --comment sandboxd:quiesce -j DROP"
        );
        assert!(lines[2].contains("-p tcp") && lines[2].ends_with("--reject-with tcp-reset"));
        assert_eq!(
            lines[3],
            "-I SANDBOXD-4-REPLY 1 -m comment --comment sandboxd:quiesce -j DROP"
        );
    }

    #[test]
    fn saved_lines_map_to_their_slot() {
        assert_eq!(slot_of(":SANDBOXD-12-EGRESS - [0:0]"), Some(12));
        assert_eq!(slot_of(":SANDBOXD-FORWARD - [0:0]"), None);
        assert_eq!(
            slot_of(
                "-A SANDBOXD-FORWARD -i sbxd3 -m comment --comment \"sandboxd:3\" -j SANDBOXD-3-EGRESS"
            ),
            Some(3)
        );
        assert_eq!(
            slot_of("-A SANDBOXD-3-EGRESS -m comment --comment \"sandboxd:quiesce\" -j DROP"),
            None
        );
        assert_eq!(slot_of("-A FORWARD -j SANDBOXD-FORWARD"), None);
    }
}
