//! What the host's connection tracking says about a sandbox's TCP endpoints
//! that the sandbox itself no longer shows.
//!
//! This runsc cannot checkpoint a sandbox whose netstack holds a TCP endpoint
//! in a connected state, and a failed checkpoint stops the sandbox. Endpoints
//! a process still owns appear in the sandbox's `/proc/net/tcp` (the agent
//! closes those), but a closed endpoint lingers invisibly: in TIME_WAIT for
//! 60 s when the sandbox closed first, in FIN_WAIT up to 60 s while the peer
//! has not closed. The host sees every such connection in
//! `/proc/net/nf_conntrack`, with its state and the seconds left on its
//! timer, and the firewall's connmark bits say who closed first: enough to
//! tell when the sandbox's last endpoint is gone.

use std::net::Ipv4Addr;
use std::time::Duration;

use super::firewall::SANDBOX_FIRST_FIN_MARK;

/// gVisor's TIME_WAIT and FIN_WAIT_2 linger (`tcp.DefaultTCPTimeWaitTimeout`,
/// `DefaultTCPLingerTimeout`), plus a margin for timer slack.
pub const NETSTACK_LINGER: Duration = Duration::from_secs(62);

/// A connection that may still have an endpoint in the sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lingering {
    pub state: String,
    pub remote: String,
    /// How long until it is certainly gone from the sandbox (an upper bound).
    pub clears_in: Duration,
}

/// Conntrack's timeout for a TCP state, from its sysctl (kernel defaults if
/// unreadable).
fn state_timeout(state: &str) -> Option<u64> {
    let (name, default) = match state {
        "TIME_WAIT" => ("time_wait", 120),
        "FIN_WAIT" => ("fin_wait", 120),
        _ => return None,
    };
    let path = format!("/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_{name}");
    Some(
        std::fs::read_to_string(path)
            .ok()
            .and_then(|text| text.trim().parse().ok())
            .unwrap_or(default),
    )
}

/// Parses `/proc/net/nf_conntrack` for connections the sandbox at `address`
/// opened that may still hold an endpoint in its netstack.
pub fn lingering(table: &str, address: Ipv4Addr) -> Vec<Lingering> {
    let source = format!("src={address}");
    table
        .lines()
        .filter_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            // ipv4 2 tcp 6 <seconds left> <STATE> src=… dst=… sport=… dport=… …
            if words.get(2) != Some(&"tcp") || words.get(6) != Some(&source.as_str()) {
                return None;
            }
            let left: u64 = words.get(4)?.parse().ok()?;
            let state = (*words.get(5)?).to_owned();
            let mark = words
                .iter()
                .find_map(|w| w.strip_prefix("mark="))
                .and_then(|m| m.parse::<u32>().ok())
                .unwrap_or(0);
            let remote = format!(
                "{}:{}",
                words.get(7)?.strip_prefix("dst=")?,
                words.get(9)?.strip_prefix("dport=")?
            );
            let clears_in = match state.as_str() {
                // Nothing left in the sandbox, or an endpoint a socket still
                // owns (the agent sees and closes those): a connecting socket
                // closed by its owner leaves nothing behind, and a half-closed
                // one becomes LAST_ACK once closed. Conntrack keeps these
                // entries long after the sandbox forgot them.
                "CLOSE" | "NONE" | "ESTABLISHED" | "SYN_SENT" | "SYN_SENT2" | "SYN_RECV"
                | "CLOSE_WAIT" => return None,
                // The peer closed first: the sandbox never entered TIME_WAIT.
                "TIME_WAIT" if mark & SANDBOX_FIRST_FIN_MARK == 0 => return None,
                "TIME_WAIT" | "FIN_WAIT" => {
                    let age = state_timeout(&state)?.saturating_sub(left);
                    NETSTACK_LINGER.saturating_sub(Duration::from_secs(age))
                }
                // LAST_ACK, CLOSING: transient once the sandbox's packets are
                // answered with resets.
                _ => Duration::from_secs(left),
            };
            (!clears_in.is_zero()).then_some(Lingering {
                state,
                remote,
                clears_in,
            })
        })
        .collect()
}

/// Reads the host's table (empty if conntrack is not loaded: then nothing
/// is tracked, and nothing was forwarded either).
pub fn read_table() -> String {
    std::fs::read_to_string("/proc/net/nf_conntrack").unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "\
ipv4     2 tcp      6 119 TIME_WAIT src=10.231.0.6 dst=198.51.100.2 sport=21222 dport=9000 src=198.51.100.2 dst=198.51.100.1 sport=9000 dport=21222 [ASSURED] mark=2097152 zone=0 use=2
ipv4     2 tcp      6 110 TIME_WAIT src=10.231.0.6 dst=198.51.100.2 sport=21223 dport=9000 src=198.51.100.2 dst=198.51.100.1 sport=9000 dport=21223 [ASSURED] mark=1048576 zone=0 use=2
ipv4     2 tcp      6 431989 ESTABLISHED src=10.231.0.6 dst=198.51.100.2 sport=21221 dport=9000 src=198.51.100.2 dst=198.51.100.1 sport=9000 dport=21221 [ASSURED] mark=0 zone=0 use=2
ipv4     2 tcp      6 9 CLOSE src=10.231.0.6 dst=198.51.100.2 sport=21224 dport=9000 src=198.51.100.2 dst=198.51.100.1 sport=9000 dport=21224 [ASSURED] mark=0 zone=0 use=2
ipv4     2 tcp      6 20 LAST_ACK src=10.231.0.6 dst=198.51.100.2 sport=21225 dport=80 src=198.51.100.2 dst=198.51.100.1 sport=80 dport=21225 [ASSURED] mark=0 zone=0 use=2
ipv4     2 tcp      6 50 TIME_WAIT src=10.231.0.6 dst=198.51.100.2 sport=21226 dport=9000 src=198.51.100.2 dst=198.51.100.1 sport=9000 dport=21226 [ASSURED] mark=2097152 zone=0 use=2
ipv4     2 tcp      6 119 TIME_WAIT src=10.231.0.10 dst=198.51.100.2 sport=1 dport=9000 src=198.51.100.2 dst=198.51.100.1 sport=9000 dport=1 [ASSURED] mark=2097152 zone=0 use=2
ipv4     2 tcp      6 110 SYN_SENT src=10.231.0.6 dst=198.51.100.9 sport=21227 dport=9000 [UNREPLIED] src=198.51.100.9 dst=198.51.100.1 sport=9000 dport=21227 mark=0 zone=0 use=2
ipv4     2 udp      17 20 src=10.231.0.6 dst=10.255.255.53 sport=5000 dport=53 src=10.255.255.53 dst=192.0.2.2 sport=53 dport=5000 mark=0 zone=0 use=2
";

    #[test]
    fn only_endpoints_the_sandbox_may_still_hold_count() {
        let found = lingering(TABLE, Ipv4Addr::new(10, 231, 0, 6));
        let summary: Vec<(&str, &str)> = found
            .iter()
            .map(|l| (l.state.as_str(), l.remote.as_str()))
            .collect();
        // The young TIME_WAIT the sandbox started, and the LAST_ACK; not the
        // peer-first TIME_WAIT, the old one, the live, connecting or closed
        // ones, UDP or another sandbox's.
        assert_eq!(
            summary,
            vec![
                ("TIME_WAIT", "198.51.100.2:9000"),
                ("LAST_ACK", "198.51.100.2:80")
            ]
        );
        assert!(found[0].clears_in <= NETSTACK_LINGER);
        assert_eq!(found[1].clears_in, Duration::from_secs(20));
    }
}
