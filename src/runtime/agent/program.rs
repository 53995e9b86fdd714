//! The agent as the program a sandbox's init runs: the `sandbox_agent`
//! Python package (`src/runtime/agent/sandbox_agent/`, one module per concern)
//! embedded in the binary, with a loader that imports it from memory.
//!
//! The init runs `python3 -S -c <program> <config>`: nothing has to exist in
//! the sandbox's image but the interpreter, and the bundle stays a pure
//! function of the configuration. The program is one `-c` argument (well
//! under the kernel's 128 KiB limit for one argument; a test checks).

use std::sync::LazyLock;

/// The package's modules, by import name (the package itself first).
/// `every_module_of_the_package_is_embedded` checks none is missing.
const MODULES: &[(&str, &str)] = &[
    ("sandbox_agent", include_str!("sandbox_agent/__init__.py")),
    (
        "sandbox_agent.protocol",
        include_str!("sandbox_agent/protocol.py"),
    ),
    (
        "sandbox_agent.config",
        include_str!("sandbox_agent/config.py"),
    ),
    (
        "sandbox_agent.safe_open",
        include_str!("sandbox_agent/safe_open.py"),
    ),
    (
        "sandbox_agent.state",
        include_str!("sandbox_agent/state.py"),
    ),
    ("sandbox_agent.flow", include_str!("sandbox_agent/flow.py")),
    (
        "sandbox_agent.execution",
        include_str!("sandbox_agent/execution.py"),
    ),
    (
        "sandbox_agent.journal",
        include_str!("sandbox_agent/journal.py"),
    ),
    (
        "sandbox_agent.checkpoint",
        include_str!("sandbox_agent/checkpoint.py"),
    ),
    (
        "sandbox_agent.snapshot",
        include_str!("sandbox_agent/snapshot.py"),
    ),
    (
        "sandbox_agent.workspace",
        include_str!("sandbox_agent/workspace.py"),
    ),
    (
        "sandbox_agent.files",
        include_str!("sandbox_agent/files.py"),
    ),
    (
        "sandbox_agent.handlers",
        include_str!("sandbox_agent/handlers.py"),
    ),
    ("sandbox_agent.loop", include_str!("sandbox_agent/loop.py")),
];

/// Imports `sandbox_agent.*` from `SOURCES` (a finder first on
/// `sys.meta_path`), then runs the agent. Tracebacks name the files.
const LOADER: &str = r#"
import sys
from importlib.machinery import ModuleSpec


class EmbeddedAgent:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in SOURCES:
            return None
        return ModuleSpec(name, cls, origin=FILES[name], is_package=name == "sandbox_agent")

    @staticmethod
    def create_module(spec):
        return None

    @staticmethod
    def exec_module(module):
        name = module.__spec__.name
        module.__file__ = FILES[name]
        exec(compile(SOURCES[name], FILES[name], "exec"), module.__dict__)


sys.meta_path.insert(0, EmbeddedAgent)
from sandbox_agent.loop import main

main()
"#;

/// The whole program the init runs with `python3 -S -c`.
pub fn agent_program() -> &'static str {
    static PROGRAM: LazyLock<String> = LazyLock::new(build);
    &PROGRAM
}

fn build() -> String {
    let mut program =
        String::from("# sandboxd agent (src/runtime/agent/sandbox_agent), embedded\n");
    program.push_str("SOURCES = {\n");
    for (name, source) in MODULES {
        // A JSON string is a valid Python string literal.
        program.push_str(&format!("    {}: {},\n", quote(name), quote(source)));
    }
    program.push_str("}\nFILES = {\n");
    for (name, _) in MODULES {
        let file = if *name == "sandbox_agent" {
            "sandbox_agent/__init__.py".to_owned()
        } else {
            format!("{}.py", name.replace('.', "/"))
        };
        program.push_str(&format!("    {}: {},\n", quote(name), quote(&file)));
    }
    program.push_str("}\n");
    program.push_str(LOADER);
    program
}

fn quote(text: &str) -> String {
    serde_json::Value::from(text).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_module_of_the_package_is_embedded() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("src/runtime/agent/sandbox_agent");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .expect("the package directory")
            .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
            .filter(|name| name.ends_with(".py") && name != "__main__.py")
            .map(|name| match name.as_str() {
                "__init__.py" => "sandbox_agent".to_owned(),
                other => format!("sandbox_agent.{}", other.trim_end_matches(".py")),
            })
            .collect();
        on_disk.sort();
        let mut embedded: Vec<String> =
            MODULES.iter().map(|(name, _)| (*name).to_owned()).collect();
        embedded.sort();
        assert_eq!(on_disk, embedded, "add new agent modules to MODULES");
    }

    #[test]
    fn the_program_fits_in_one_argument() {
        // MAX_ARG_STRLEN: 32 pages.
        assert!(
            agent_program().len() < 128 * 1024 - 1,
            "the agent program is {} bytes",
            agent_program().len()
        );
    }

    #[test]
    fn the_program_compiles_as_python() {
        let checked = std::process::Command::new("python3")
            .args([
                "-S",
                "-c",
                "import sys; compile(sys.stdin.read(), '<agent>', 'exec')",
            ])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                use std::io::Write as _;
                child
                    .stdin
                    .take()
                    .expect("piped")
                    .write_all(agent_program().as_bytes())?;
                child.wait()
            })
            .expect("python3 runs");
        assert!(
            checked.success(),
            "the embedded agent program does not compile"
        );
    }
}
