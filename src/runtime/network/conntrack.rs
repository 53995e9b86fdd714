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
use std::path::Path;
use std::time::Duration;

use super::firewall::SANDBOX_FIRST_FIN_MARK;

/// gVisor's TIME_WAIT and FIN_WAIT_2 linger (`tcp.DefaultTCPTimeWaitTimeout`,
/// `DefaultTCPLingerTimeout`), plus a margin for timer slack.
pub const NETSTACK_LINGER: Duration = Duration::from_secs(62);

/// The host's connection tracking table.
const TABLE_PATH: &str = "/proc/net/nf_conntrack";
/// Where conntrack's timeouts are (`nf_conntrack_tcp_timeout_<state>`).
const SYSCTL_DIR: &str = "/proc/sys/net/netfilter";

/// Why the host's view of the sandbox's connections is unavailable. The guard
/// treats every one of these as "not quiet": without the table it cannot
/// know, and a wrong guess loses the sandbox.
#[derive(Debug, thiserror::Error)]
pub enum ConntrackError {
    #[error(
        "cannot read the host's connection tracking table {TABLE_PATH} ({source}); egress \
         sandboxes need it to checkpoint safely: load nf_conntrack (`modprobe nf_conntrack`) \
         on a kernel built with CONFIG_NF_CONNTRACK_PROCFS"
    )]
    Unreadable { source: std::io::Error },
    #[error(
        "cannot read net.netfilter.nf_conntrack_tcp_timeout_{state} ({source}); the checkpoint \
         guard needs it to age closing connections"
    )]
    Timeout {
        state: &'static str,
        source: std::io::Error,
    },
    #[error(
        "net.netfilter.nf_conntrack_tcp_timeout_{state} is {seconds} s, shorter than the {} s \
         gVisor keeps a closed connection: the checkpoint guard would not see it; raise it \
         (`sysctl -w net.netfilter.nf_conntrack_tcp_timeout_{state}=120`, the kernel default)",
        NETSTACK_LINGER.as_secs()
    )]
    TimeoutTooShort { state: &'static str, seconds: u64 },
    #[error("reading the connection tracking table: {0}")]
    Join(#[from] tokio::task::JoinError),
}

/// Conntrack's timeouts for the states whose age the guard computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateTimeouts {
    pub time_wait: u64,
    pub fin_wait: u64,
    pub close_wait: u64,
}

impl StateTimeouts {
    /// Kernel defaults (`nf_conntrack_tcp_timeout_{time_wait,fin_wait,close_wait}`).
    pub const KERNEL_DEFAULT: Self = Self {
        time_wait: 120,
        fin_wait: 120,
        close_wait: 60,
    };

    fn of(&self, state: &str) -> Option<u64> {
        match state {
            "TIME_WAIT" => Some(self.time_wait),
            "FIN_WAIT" => Some(self.fin_wait),
            "CLOSE_WAIT" => Some(self.close_wait),
            _ => None,
        }
    }

    /// Reads the sysctls (blocking: call off the async workers). A TIME_WAIT
    /// or FIN_WAIT timeout shorter than gVisor's linger would let an entry
    /// vanish while the sandbox still holds the endpoint, so it is an error,
    /// not a default. (CLOSE_WAIT's 60 s default is left as it is: see
    /// [`lingering`].)
    fn read(dir: &Path) -> Result<Self, ConntrackError> {
        let read = |state: &'static str, minimum: u64| {
            let path = dir.join(format!("nf_conntrack_tcp_timeout_{state}"));
            let text = std::fs::read_to_string(path)
                .map_err(|source| ConntrackError::Timeout { state, source })?;
            let seconds: u64 = text.trim().parse().map_err(|_| ConntrackError::Timeout {
                state,
                source: std::io::Error::other(format!("not a number: {:?}", text.trim())),
            })?;
            if seconds < minimum {
                return Err(ConntrackError::TimeoutTooShort { state, seconds });
            }
            Ok(seconds)
        };
        let linger = NETSTACK_LINGER.as_secs();
        Ok(Self {
            time_wait: read("time_wait", linger)?,
            fin_wait: read("fin_wait", linger)?,
            close_wait: read("close_wait", 0)?,
        })
    }
}

/// A connection that may still have an endpoint in the sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lingering {
    pub state: String,
    pub remote: String,
    /// How long until it is certainly gone from the sandbox (an upper bound).
    pub clears_in: Duration,
}

/// Parses `/proc/net/nf_conntrack` for connections the sandbox at `address`
/// opened that may still hold an endpoint in its netstack.
pub fn lingering(table: &str, address: Ipv4Addr, timeouts: StateTimeouts) -> Vec<Lingering> {
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
            let mut state = (*words.get(5)?).to_owned();
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
                // Conntrack's CLOSE_WAIT is direction-blind: after the
                // sandbox's own FIN was acknowledged it means the sandbox
                // waits in FIN_WAIT_2 for the peer's FIN, an endpoint gVisor
                // keeps, closed and unseen, for its linger. (Conntrack drops
                // the entry after its close_wait timeout, 60 s by default,
                // about when gVisor's linger ends.)
                "CLOSE_WAIT" if mark & SANDBOX_FIRST_FIN_MARK != 0 => {
                    let age = timeouts.of(&state)?.saturating_sub(left);
                    state = "FIN_WAIT".to_owned();
                    NETSTACK_LINGER.saturating_sub(Duration::from_secs(age))
                }
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
                    let age = timeouts.of(&state)?.saturating_sub(left);
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

/// Reads the host's table and timeouts, blocking.
fn read_blocking() -> Result<(String, StateTimeouts), ConntrackError> {
    read_from(Path::new(TABLE_PATH), Path::new(SYSCTL_DIR))
}

fn read_from(table: &Path, sysctls: &Path) -> Result<(String, StateTimeouts), ConntrackError> {
    let text =
        std::fs::read_to_string(table).map_err(|source| ConntrackError::Unreadable { source })?;
    Ok((text, StateTimeouts::read(sysctls)?))
}

/// Checks that the guard can see: the table is readable and conntrack keeps
/// closing connections at least as long as gVisor does. If the table is
/// missing, loads `nf_conntrack` once (when `modprobe` is there) and looks
/// again.
pub async fn check_usable() -> Result<(), ConntrackError> {
    match tokio::task::spawn_blocking(read_blocking).await? {
        Err(ConntrackError::Unreadable { .. }) => {
            if let Err(err) = super::command::run("modprobe", &["nf_conntrack"], None).await {
                tracing::debug!(%err, "could not load nf_conntrack");
            }
            tokio::task::spawn_blocking(read_blocking).await?.map(drop)
        }
        other => other.map(drop),
    }
}

/// The connections of the sandbox at `address` that may still hold an
/// endpoint in its netstack, as the host's table shows them now. An
/// unreadable table is an error, never "nothing there".
pub async fn snapshot(address: Ipv4Addr) -> Result<Vec<Lingering>, ConntrackError> {
    let (table, timeouts) = tokio::task::spawn_blocking(read_blocking).await??;
    Ok(lingering(&table, address, timeouts))
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
ipv4     2 tcp      6 50 CLOSE_WAIT src=10.231.0.6 dst=198.51.100.2 sport=21228 dport=9000 src=198.51.100.2 dst=198.51.100.1 sport=9000 dport=21228 [ASSURED] mark=2097152 zone=0 use=2
ipv4     2 tcp      6 50 CLOSE_WAIT src=10.231.0.6 dst=198.51.100.2 sport=21229 dport=9001 src=198.51.100.2 dst=198.51.100.1 sport=9001 dport=21229 [ASSURED] mark=1048576 zone=0 use=2
ipv4     2 udp      17 20 src=10.231.0.6 dst=10.255.255.53 sport=5000 dport=53 src=10.255.255.53 dst=192.0.2.2 sport=53 dport=5000 mark=0 zone=0 use=2
";

    /// A table file and a sysctl directory with the given timeouts.
    fn sources(time_wait: &str, fin_wait: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("table"), TABLE).expect("table");
        let states = [
            ("time_wait", time_wait),
            ("fin_wait", fin_wait),
            ("close_wait", "60"),
        ];
        for (state, value) in states {
            std::fs::write(
                dir.path().join(format!("nf_conntrack_tcp_timeout_{state}")),
                value,
            )
            .expect("sysctl");
        }
        dir
    }

    #[test]
    fn what_the_guard_cannot_read_is_an_error_never_an_empty_table() {
        let dir = sources("120\n", "120\n");
        let (table, timeouts) = read_from(&dir.path().join("table"), dir.path()).expect("readable");
        assert_eq!(table, TABLE);
        assert_eq!(timeouts, StateTimeouts::KERNEL_DEFAULT);
        let missing = read_from(&dir.path().join("nf_conntrack"), dir.path());
        assert!(
            matches!(missing, Err(ConntrackError::Unreadable { .. })),
            "{missing:?}"
        );
        let no_sysctls = read_from(&dir.path().join("table"), &dir.path().join("none"));
        assert!(
            matches!(no_sysctls, Err(ConntrackError::Timeout { .. })),
            "{no_sysctls:?}"
        );
    }

    #[test]
    fn a_conntrack_timeout_shorter_than_gvisors_linger_is_refused() {
        // Conntrack would forget a TIME_WAIT the sandbox still holds.
        let dir = sources("30", "120");
        let short = read_from(&dir.path().join("table"), dir.path());
        assert!(
            matches!(
                short,
                Err(ConntrackError::TimeoutTooShort {
                    state: "time_wait",
                    seconds: 30
                })
            ),
            "{short:?}"
        );
        let dir = sources("120", "soon");
        assert!(read_from(&dir.path().join("table"), dir.path()).is_err());
    }

    #[test]
    fn only_endpoints_the_sandbox_may_still_hold_count() {
        let found = lingering(
            TABLE,
            Ipv4Addr::new(10, 231, 0, 6),
            StateTimeouts::KERNEL_DEFAULT,
        );
        let summary: Vec<(&str, &str)> = found
            .iter()
            .map(|l| (l.state.as_str(), l.remote.as_str()))
            .collect();
        // The young TIME_WAIT the sandbox started, the LAST_ACK, and the
        // CLOSE_WAIT after the sandbox's FIN (its FIN_WAIT_2); not the
        // peer-first TIME_WAIT or CLOSE_WAIT, the old one, the live,
        // connecting or closed ones, UDP or another sandbox's.
        assert_eq!(
            summary,
            vec![
                ("TIME_WAIT", "198.51.100.2:9000"),
                ("LAST_ACK", "198.51.100.2:80"),
                ("FIN_WAIT", "198.51.100.2:9000"),
            ]
        );
        assert!(found[0].clears_in <= NETSTACK_LINGER);
        assert_eq!(found[1].clears_in, Duration::from_secs(20));
        // 10 s into conntrack's 60 s CLOSE_WAIT: 52 s of gVisor's 62 left.
        assert_eq!(found[2].clears_in, Duration::from_secs(52));
    }
}
