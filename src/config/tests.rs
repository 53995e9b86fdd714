//! Flag and environment parsing, decided without touching the process
//! environment.

use clap::Parser;

use super::*;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

fn parse(args: &[&str]) -> ServeArgs {
    Cli::try_parse_from(std::iter::once("sandboxd").chain(args.iter().copied()))
        .unwrap()
        .serve
}

#[test]
fn mount_path_wins_over_bucket_and_bucket_over_local() {
    let args = parse(&[
        "--metadata-bucket",
        "meta",
        "--metadata-mount-path",
        "/mnt/meta",
        "--checkpoint-bucket",
        "ckpt",
        "--storage-emulator-host",
        "127.0.0.3:80",
        "--data-dir",
        "/var/lib/sandboxd",
    ]);
    let layout = args.storage.layout();
    assert_eq!(
        layout.metadata,
        StoreLocation::Directory("/mnt/meta".into())
    );
    assert_eq!(
        layout.checkpoints,
        StoreLocation::Bucket {
            bucket: "ckpt".into(),
            emulator_host: Some("127.0.0.3:80".into())
        }
    );
    assert_eq!(
        layout.snapshots,
        StoreLocation::Directory("/var/lib/sandboxd".into())
    );
}

#[test]
fn network_defaults_to_none_and_egress_settings_are_checked() {
    let default = parse(&[]);
    assert_eq!(
        default.network.modes().unwrap(),
        vec![controllers::api::NetworkMode::None]
    );
    assert_eq!(default.network.config().unwrap(), None);
    let egress = parse(&[
        "--network-modes",
        "none,egress",
        "--network-deny",
        "203.0.113.0/24",
        "--network-nameservers",
        "10.0.0.2",
    ]);
    let config = egress.network.config().unwrap().unwrap();
    assert_eq!(config.range.to_string(), "10.231.0.0/16");
    assert_eq!(config.deny.len(), 1);
    assert_eq!(config.nameservers, vec![Ipv4Addr::new(10, 0, 0, 2)]);
    for bad in [
        &["--network-modes", "bridge"][..],
        &[
            "--network-modes",
            "egress",
            "--network-range",
            "10.0.0.0/33",
        ][..],
        &["--network-modes", "egress", "--network-allow", "x"][..],
        &[
            "--network-modes",
            "egress",
            "--network-nameservers",
            "dns.google",
        ][..],
    ] {
        assert!(parse(bad).network.config().is_err(), "{bad:?}");
    }
}

#[test]
fn listen_address_prefers_flag_then_port() {
    assert_eq!(
        parse(&["--listen", "127.0.0.1:9000"]).listen_addr().port(),
        9000
    );
    let from_port = parse(&["--port", "8081"]).listen_addr();
    assert_eq!(from_port, "0.0.0.0:8081".parse().unwrap());
}

/// Every numeric flag is range-checked when parsed. A lease of
/// `u64::MAX` seconds used to pass and panic later (`chrono` overflow when the
/// lease settings were built).
#[test]
fn numeric_flags_out_of_range_are_refused_when_parsed() {
    for (flag, value) in [
        ("--lease-duration-s", "18446744073709551615"),
        ("--lease-duration-s", "0"),
        ("--clock-skew-s", "9223372036854775807"),
        ("--resync-interval-s", "0"),
        ("--tombstone-retention-s", "18446744073709551615"),
        ("--checkpoint-interval-s", "18446744073709551615"),
        ("--keep-checkpoints", "18446744073709551615"),
        ("--shutdown-grace-s", "18446744073709551615"),
        ("--sandbox-memory-mb", "18446744073709551615"),
        ("--sandbox-cpus", "NaN"),
        ("--sandbox-cpus", "-1"),
        ("--sandbox-cpus", "inf"),
        ("--workspace-max-file-mb", "18446744073709551615"),
        ("--workspace-sync-timeout-s", "0"),
        ("--runsc-timeout-s", "18446744073709551615"),
        ("--memory-capacity-mb", "0"),
        ("--memory-capacity-mb", "18446744073709551615"),
        ("--memory-reserve-mb", "18446744073709551615"),
        ("--admission-wait-s", "18446744073709551615"),
        ("--max-concurrent-executes", "0"),
        ("--max-concurrent-forks", "0"),
        ("--max-named-checkpoints", "18446744073709551615"),
        ("--max-connections", "0"),
        ("--max-connections", "4294967295"),
        ("--ws-early-frames-budget-bytes", "1048576"),
        ("--ws-early-frames-budget-bytes", "18446744073709551615"),
    ] {
        let err = Cli::try_parse_from(["sandboxd".to_owned(), format!("{flag}={value}")])
            .err()
            .unwrap_or_else(|| panic!("{flag} {value} was accepted"))
            .to_string();
        assert!(err.contains(flag), "{flag} {value}: {err}");
    }
    let args = parse(&["--lease-duration-s", "3600", "--sandbox-cpus", "0.5"]);
    assert_eq!(args.control.lease_duration_s, 3600);
    assert!(args.control.lease().duration > chrono::Duration::zero());
}

/// Admission's capacity is the flag minus the reserve; settings that leave
/// no room for one sandbox are an error naming the flags; no per-sandbox
/// limit turns admission off.
#[test]
fn admission_settings_come_from_the_capacity_minus_the_reserve() {
    let args = parse(&["--memory-capacity-mb", "4608", "--memory-reserve-mb", "512"]);
    let buffers = 60 << 20;
    let settings = args.admission.settings(2048, buffers, 2).unwrap().unwrap();
    assert_eq!(settings.capacity_bytes, 4096 << 20);
    assert_eq!(settings.sandbox_bytes, (2048 << 20) + buffers);
    assert_eq!(settings.wait, std::time::Duration::from_secs(30));
    let err = args
        .admission
        .settings(8192, buffers, 2)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--memory-reserve-mb") && err.contains("--sandbox-memory-mb 8192"),
        "{err}"
    );
    // A sandbox that fits only without its session's buffers does not fit.
    let err = args
        .admission
        .settings(4096, buffers, 2)
        .unwrap_err()
        .to_string();
    assert!(err.contains("60 MiB of the server's buffers"), "{err}");
    assert!(args.admission.settings(4096, 0, 2).is_ok());
    assert!(args.admission.settings(0, buffers, 2).unwrap().is_none());
    // Unset: detected from this machine (a cgroup limit or MemTotal).
    let detected = parse(&[]).admission.settings(1, 0, 0).unwrap().unwrap();
    assert!(detected.capacity_bytes > 0);
}

#[test]
fn the_workspace_syncs_no_more_than_its_mount_holds() {
    // Defaults: 2048 MiB of memory, a 1024 MiB disk budget, a 512 MiB
    // `/workspace`: the sync's 1024 MiB default is held to it.
    let args = parse(&[]);
    assert_eq!(args.runtime.disk_size_mb(), 1024);
    assert_eq!(args.runtime.workspace_size_mb(), 512);
    let limits = args.workspace.limits(args.runtime.workspace_size_mb());
    assert_eq!(limits.max_total_bytes, 512 << 20);
    // A larger budget lets the configured total through, no further.
    let args = parse(&[
        "--sandbox-disk-mb",
        "8192",
        "--workspace-max-total-mb",
        "3000",
    ]);
    let limits = args.workspace.limits(args.runtime.workspace_size_mb());
    assert_eq!(limits.max_total_bytes, 3000 << 20);
}

/// The connection limit and the budget of frames kept while handshakes
/// wait are the operator's to size to the instance's memory.
#[test]
fn the_connection_limit_and_the_early_frames_budget_are_flags() {
    let defaults = parse(&[]);
    assert_eq!(defaults.tenant.max_connections, 4096);
    assert_eq!(defaults.tenant.ws_early_frames_budget_bytes, 64 << 20);
    let args = parse(&[
        "--max-connections",
        "512",
        "--ws-early-frames-budget-bytes",
        "8388608",
    ]);
    assert_eq!(args.tenant.max_connections, 512);
    assert_eq!(args.tenant.ws_early_frames_budget_bytes, 8 << 20);
    // The smallest budget still fits one message of the largest size.
    let least = parse(&["--ws-early-frames-budget-bytes", "4194304"]);
    assert_eq!(
        least.tenant.ws_early_frames_budget_bytes,
        crate::api::protocol::MAX_MESSAGE_BYTES
    );
}
