//! The deployment files say what the docs promise: the Cloud Run service is
//! gen2 with concurrency 1 and session affinity, the image's runtime stage
//! installs a current runsc (checked), and the scripts parse.

use std::path::Path;
use std::process::Command;

fn repo(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// The YAML as JSON, parsed by PyYAML (python3 is a test prerequisite anyway).
fn yaml_as_json(path: &Path) -> serde_json::Value {
    let output = Command::new("python3")
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))",
        ])
        .arg(path)
        .output()
        .expect("python3");
    assert!(
        output.status.success(),
        "the YAML must parse (and PyYAML be installed: pip install pyyaml): {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

#[test]
fn the_cloud_run_service_is_gen2_with_concurrency_one_and_affinity() {
    let service = yaml_as_json(&repo("deploy/cloudrun/service.yaml"));
    assert_eq!(service["kind"], "Service");
    let template = &service["spec"]["template"];
    let annotations = &template["metadata"]["annotations"];
    assert_eq!(
        annotations["run.googleapis.com/execution-environment"],
        "gen2"
    );
    assert_eq!(annotations["run.googleapis.com/sessionAffinity"], "true");
    assert_eq!(annotations["run.googleapis.com/cpu-throttling"], "false");
    assert_eq!(template["spec"]["containerConcurrency"], 1);
    assert!(template["spec"]["timeoutSeconds"].as_u64().unwrap() >= 600);
    let container = &template["spec"]["containers"][0];
    let env: Vec<&str> = container["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    for variable in [
        "SANDBOX_METADATA_BUCKET",
        "SANDBOX_CHECKPOINT_BUCKET",
        "LOG_FORMAT",
    ] {
        assert!(env.contains(&variable), "{variable} in {env:?}");
    }
    assert_eq!(container["startupProbe"]["httpGet"]["path"], "/readyz");
}

#[test]
fn the_images_runtime_stage_installs_a_checked_runsc() {
    let dockerfile = std::fs::read_to_string(repo("deploy/Dockerfile")).unwrap();
    let runtime = dockerfile
        .split("\nFROM ")
        .find(|stage| stage.contains("AS runtime"))
        .expect("a runtime stage");
    assert!(
        runtime.contains("storage.googleapis.com/gvisor/releases"),
        "runsc from gVisor's releases"
    );
    assert!(runtime.contains("sha512sum -c"), "its checksum verified");
    assert!(runtime.contains("install -m 0755 runsc /usr/local/bin/runsc"));
    assert!(dockerfile.contains("cargo build --release --locked"));
}

#[test]
fn the_image_carries_the_sandbox_image_built_by_the_same_script() {
    let dockerfile = std::fs::read_to_string(repo("deploy/Dockerfile")).unwrap();
    let stage = |name: &str| {
        dockerfile
            .split("\nFROM ")
            .find(|stage| stage.contains(&format!("AS {name}")))
            .unwrap_or_else(|| panic!("a {name} stage"))
            .to_owned()
    };
    let image = stage("sandbox-image");
    assert!(image.contains("mmdebstrap"), "{image}");
    assert!(
        image.contains("scripts/build-image.sh --images /var/lib/sandboxd/images --name default"),
        "the same script as everywhere: {image}"
    );
    let runtime = stage("runtime");
    assert!(runtime.contains("from=sandbox-image"), "{runtime}");
    assert!(
        runtime.contains("SANDBOXD_IMAGES=/var/lib/sandboxd/images"),
        "{runtime}"
    );
    // Sandboxes no longer run on the container's own root filesystem.
    assert!(!runtime.contains("useradd"), "{runtime}");
    assert!(repo("scripts/build-image.sh").exists());
}

#[test]
fn the_bucket_rules_and_scripts_parse() {
    let lifecycle: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo("deploy/bucket-lifecycle.json")).unwrap(),
    )
    .unwrap();
    assert!(lifecycle["rule"].is_array());
    // No age-based delete of checkpoints: it would remove a sleeping sandbox's only one.
    assert!(!lifecycle.to_string().contains("sandbox_checkpoints"));
    for script in ["deploy/deploy.sh", "deploy/local/run.sh"] {
        let status = Command::new("bash")
            .arg("-n")
            .arg(repo(script))
            .status()
            .unwrap();
        assert!(status.success(), "{script} has a syntax error");
    }
}
