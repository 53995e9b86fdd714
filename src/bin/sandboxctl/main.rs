//! `sandboxctl`: user verbs against a server (`run`, `create`, `attach`,
//! `checkpoint`, `snapshot`, `kill`) and operator verbs on the bucket's
//! documents (`list`, `get`, `describe`, `edit`, `evict`, `delete`,
//! `break-lease`, `gc`).
//!
//! Exit codes: user verbs `run`/`attach` pass the process's exit code through;
//! otherwise 0 success, 1 the server refused or failed, 2 invalid input,
//! 3 not found, 4 storage error, 5 conflict (a concurrent change), 6 cancelled.

use std::process::ExitCode;

use clap::Parser as _;
use controllers::api::SandboxId;
use sandboxd::client::{ClientError, CreateOptions};
use sandboxd::ctl::{self, OperatorError, UserCommand};
use sandboxd::store;

mod cli;

use cli::{Cli, Command, Format};

const EXIT_REFUSED: u8 = 1;
const EXIT_USAGE: u8 = 2;
const EXIT_NOT_FOUND: u8 = 3;
const EXIT_STORAGE: u8 = 4;

#[tokio::main]
async fn main() -> ExitCode {
    sandboxd::tls::install_crypto_provider();
    let cli = Cli::parse();
    let user = match &cli.command {
        Command::Run {
            language,
            code,
            server,
        } => {
            let code = if code == "-" {
                let mut text = String::new();
                if let Err(err) = std::io::Read::read_to_string(&mut std::io::stdin(), &mut text) {
                    return fail(
                        EXIT_USAGE,
                        &format!("cannot read the code from stdin: {err}"),
                    );
                }
                text
            } else {
                code.clone()
            };
            Some(UserCommand::Run {
                url: server.url.clone(),
                language: (*language).into(),
                code,
            })
        }
        Command::Create {
            idle_timeout,
            checkpoint,
            keep_executions,
            snapshot,
            snapshot_token,
            image,
            workspace,
            workspace_token,
            workspace_template,
            server,
        } => Some(UserCommand::Create {
            url: server.url.clone(),
            options: CreateOptions {
                idle_timeout_s: (*idle_timeout > 0).then_some(*idle_timeout),
                enable_checkpoint: *checkpoint,
                enable_sandbox_handoff: *checkpoint,
                enable_idle_timeout_auto_checkpoint: false,
                keep_executions: *keep_executions,
                filesystem_snapshot_name: snapshot.clone(),
                filesystem_snapshot_token: snapshot_token.clone(),
                image: image.clone(),
                workspace_id: workspace.clone(),
                workspace_token: workspace_token.clone(),
                workspace_template: workspace_template.clone(),
                ..CreateOptions::default()
            },
        }),
        Command::Fork {
            target,
            checkpoint,
            idle_timeout,
        } => Some(UserCommand::Create {
            url: target.server.url.clone(),
            options: CreateOptions {
                idle_timeout_s: (*idle_timeout > 0).then_some(*idle_timeout),
                enable_checkpoint: true,
                enable_sandbox_handoff: true,
                from_checkpoint: Some(sandboxd::client::ForkSource {
                    sandbox_id: target.id.clone(),
                    sandbox_token: target.token.clone(),
                    name: checkpoint.clone(),
                }),
                ..CreateOptions::default()
            },
        }),
        Command::Attach {
            target,
            checkpoint,
            language,
            code,
        } => Some(UserCommand::Attach {
            url: target.server.url.clone(),
            id: target.id.clone(),
            token: target.token.clone(),
            checkpoint: checkpoint.clone(),
            language: (*language).into(),
            code: code.clone(),
        }),
        Command::Checkpoint { target, name } => Some(UserCommand::Checkpoint {
            url: target.server.url.clone(),
            id: target.id.clone(),
            token: target.token.clone(),
            name: name.clone(),
        }),
        Command::Snapshot { target, name } => Some(UserCommand::Snapshot {
            url: target.server.url.clone(),
            id: target.id.clone(),
            token: target.token.clone(),
            name: name.clone(),
        }),
        Command::Kill { target } => Some(UserCommand::Kill {
            url: target.server.url.clone(),
            id: target.id.clone(),
            token: target.token.clone(),
        }),
        _ => None,
    };
    if let Command::Mcp {
        idle_timeout,
        keep_sandboxes,
        server,
    } = &cli.command
    {
        // Logs go to stderr: stdout is the protocol's.
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
            )
            .try_init();
        let options = ctl::McpOptions {
            url: server.url.clone(),
            idle_timeout_s: *idle_timeout,
            keep_sandboxes: *keep_sandboxes,
        };
        let code = match ctl::serve_mcp(options).await {
            Ok(()) => 0,
            Err(err) => {
                eprintln!("sandboxctl: {err}");
                i32::from(EXIT_REFUSED)
            }
        };
        // Exits at once: the runtime would otherwise wait for a pending read
        // of stdin (after SIGTERM, the client may keep it open).
        std::process::exit(code);
    }
    if let Command::Shell { target, command } = &cli.command {
        let code = match ctl::shell(&target.server.url, &target.id, &target.token, command).await {
            Ok(code) => code,
            Err(err) => {
                eprintln!("sandboxctl: {err}");
                if err == ClientError::NotFound {
                    EXIT_NOT_FOUND
                } else {
                    EXIT_REFUSED
                }
            }
        };
        // Exits at once: the runtime would otherwise wait for the thread
        // blocked reading the terminal (tokio's stdin) until a key is pressed.
        std::process::exit(i32::from(code));
    }
    let files = match &cli.command {
        Command::Cp {
            from,
            to,
            token,
            server,
        } => Some(ctl::FilesCommand::Cp {
            url: server.url.clone(),
            token: token.clone(),
            from: ctl::CpSide::parse(from),
            to: ctl::CpSide::parse(to),
        }),
        Command::Ls {
            target,
            path,
            depth,
        } => Some(ctl::FilesCommand::Ls {
            url: target.server.url.clone(),
            id: target.id.clone(),
            token: target.token.clone(),
            path: path.clone(),
            depth: *depth,
        }),
        Command::Cat { target, path } => Some(ctl::FilesCommand::Cat {
            url: target.server.url.clone(),
            id: target.id.clone(),
            token: target.token.clone(),
            path: path.clone(),
        }),
        _ => None,
    };
    if let Some(files) = files {
        return match ctl::run_files_command(files).await {
            Ok(code) => ExitCode::from(code),
            Err(err @ ClientError::NotFound) => fail(EXIT_NOT_FOUND, &err.to_string()),
            Err(err @ ClientError::Fs { .. }) if err.to_string().starts_with("ENOENT") => {
                fail(EXIT_NOT_FOUND, &err.to_string())
            }
            Err(err @ ClientError::Invalid(_)) => fail(EXIT_USAGE, &err.to_string()),
            Err(err) => fail(EXIT_REFUSED, &err.to_string()),
        };
    }
    if let Some(user) = user {
        return match ctl::run_user_command(user).await {
            Ok(code) => ExitCode::from(code),
            Err(err @ ClientError::NotFound) => fail(EXIT_NOT_FOUND, &err.to_string()),
            Err(err @ ClientError::Invalid(_)) => fail(EXIT_USAGE, &err.to_string()),
            Err(err) => fail(EXIT_REFUSED, &err.to_string()),
        };
    }
    if let Command::Images {
        json,
        server,
        operator_token,
    } = &cli.command
    {
        return match ctl::fetch_images(&server.url, operator_token.as_deref()).await {
            Ok(listing) if *json => {
                println!("{listing:#}");
                ExitCode::SUCCESS
            }
            Ok(listing) => {
                print!("{}", ctl::render_images(&listing));
                ExitCode::SUCCESS
            }
            Err(err) => fail(EXIT_REFUSED, &err.to_string()),
        };
    }
    let layout = cli.storage.layout();
    if let Command::PushImage { name, runtime } = &cli.command {
        let checkpoints = match store::open(&layout.checkpoints).await {
            Ok(store) => store,
            Err(err) => return fail(EXIT_STORAGE, &err.to_string()),
        };
        let catalog = runtime.images();
        let scratch = sandboxd::runtime::images::store::default_scratch(&catalog);
        return match sandboxd::runtime::images::store::push(
            &catalog,
            checkpoints.as_ref(),
            name,
            &scratch,
        )
        .await
        {
            Ok((image, true)) => {
                println!("pushed {name} = {}", image.digest);
                ExitCode::SUCCESS
            }
            Ok((image, false)) => {
                println!("the store has {name} = {} already", image.digest);
                ExitCode::SUCCESS
            }
            Err(err) => fail(EXIT_REFUSED, &err.to_string()),
        };
    }
    if let Command::ReadyTemplate {
        name,
        python,
        bash,
        timeout_s,
        base,
        runtime,
    } = &cli.command
    {
        use sandboxd::runtime::images::ready::{ReadyCommand, ReadyLanguage};
        let (language, code) = match (python, bash) {
            (Some(code), _) => (ReadyLanguage::Python, code.clone()),
            (None, Some(code)) => (ReadyLanguage::Bash, code.clone()),
            (None, None) => return fail(EXIT_USAGE, "give --python or --bash"),
        };
        let command = ReadyCommand {
            language,
            code,
            timeout_s: *timeout_s,
        };
        let catalog = runtime.images();
        let scratch = sandboxd::runtime::images::templates::default_scratch(&catalog);
        return match sandboxd::runtime::images::templates::ready_template(
            &catalog,
            name,
            base.as_deref(),
            &command,
            &scratch,
        )
        .await
        {
            Ok(image) => {
                println!("ready template {name} = {}", image.digest);
                ExitCode::SUCCESS
            }
            Err(err) => fail(EXIT_REFUSED, &err.to_string()),
        };
    }
    if let Command::Template {
        name,
        from_snapshot,
        base,
        runtime,
    } = &cli.command
    {
        let snapshots = match store::open(&layout.snapshots).await {
            Ok(store) => store,
            Err(err) => return fail(EXIT_STORAGE, &err.to_string()),
        };
        let catalog = runtime.images();
        let scratch = sandboxd::runtime::images::templates::default_scratch(&catalog);
        return match sandboxd::runtime::images::templates::template_from_snapshot(
            &catalog,
            snapshots.as_ref(),
            from_snapshot,
            name,
            base.as_deref(),
            &scratch,
        )
        .await
        {
            Ok(image) => {
                println!(
                    "image {name} = {} ({})",
                    image.digest,
                    image.rootfs.display()
                );
                ExitCode::SUCCESS
            }
            Err(err @ sandboxd::runtime::images::templates::TemplateError::NoSnapshot(_)) => {
                fail(EXIT_NOT_FOUND, &err.to_string())
            }
            Err(err) => fail(EXIT_REFUSED, &err.to_string()),
        };
    }
    let store = match store::open(&layout.metadata).await {
        Ok(store) => store,
        Err(err) => return fail(EXIT_STORAGE, &err.to_string()),
    };
    #[allow(
        clippy::disallowed_methods,
        reason = "sandboxctl runs on the operator's machine, outside any instance: its time is the host's"
    )]
    let now = chrono::Utc::now();
    let report = |result: Result<String, OperatorError>| match result {
        Ok(message) => {
            println!("{}", message.trim_end());
            ExitCode::SUCCESS
        }
        Err(err) => fail(err.exit_code(), &err.to_string()),
    };
    match cli.command {
        Command::List => match ctl::list_rows(store.as_ref(), now).await {
            Ok(rows) => {
                print!("{}", ctl::render_table(&rows));
                ExitCode::SUCCESS
            }
            Err(err) => fail(EXIT_STORAGE, &err.to_string()),
        },
        Command::Get { id, output } => {
            let sandbox = match SandboxId::parse(&id) {
                Ok(sandbox) => sandbox,
                Err(err) => return fail(EXIT_USAGE, &err.to_string()),
            };
            match ctl::describe_json(store.as_ref(), &sandbox).await {
                Ok(value) => {
                    match output {
                        Format::Json => println!(
                            "{}",
                            serde_json::to_string_pretty(&value).unwrap_or_default()
                        ),
                        Format::Yaml => print!("{}", ctl::to_yaml(&value)),
                    }
                    ExitCode::SUCCESS
                }
                Err(err @ controllers::store::StoreError::NotFound { .. }) => {
                    fail(EXIT_NOT_FOUND, &format!("no such sandbox: {err}"))
                }
                Err(err) => fail(EXIT_STORAGE, &err.to_string()),
            }
        }
        Command::Describe { id } => report(ctl::describe(store.as_ref(), &id, now).await),
        Command::Edit { id } => {
            let editor = std::env::var("VISUAL")
                .or_else(|_| std::env::var("EDITOR"))
                .unwrap_or_else(|_| "vi".to_owned());
            report(ctl::edit(store.as_ref(), &id, &editor, &std::env::temp_dir()).await)
        }
        Command::Evict { id } => report(ctl::evict(store.as_ref(), &id).await),
        Command::Delete { id } => report(ctl::delete(store.as_ref(), &id).await),
        Command::BreakLease { id, yes } => {
            if !yes && !confirm(&id) {
                return fail(OperatorError::Cancelled.exit_code(), "cancelled");
            }
            report(ctl::break_lease(store.as_ref(), &id).await)
        }
        Command::Checkpoints { id, delete, output } => {
            let checkpoints = match store::open(&layout.checkpoints).await {
                Ok(store) => store,
                Err(err) => return fail(EXIT_STORAGE, &err.to_string()),
            };
            if let Some(target) = delete {
                return report(
                    ctl::delete_checkpoint_entry(
                        store.as_ref(),
                        checkpoints.as_ref(),
                        &id,
                        &target,
                    )
                    .await,
                );
            }
            match ctl::list_checkpoints(store.as_ref(), checkpoints.as_ref(), &id).await {
                Ok(rows) => {
                    match output {
                        None => print!("{}", ctl::render_checkpoints(&rows, now)),
                        Some(Format::Json) => println!(
                            "{}",
                            serde_json::to_string_pretty(&rows).unwrap_or_default()
                        ),
                        Some(Format::Yaml) => print!(
                            "{}",
                            ctl::to_yaml(&serde_json::to_value(&rows).unwrap_or_default())
                        ),
                    }
                    ExitCode::SUCCESS
                }
                Err(err) => fail(err.exit_code(), &err.to_string()),
            }
        }
        Command::Gc {
            dry_run,
            older_than_s,
            keep_checkpoints,
            snapshot_retention_days,
        } => {
            let checkpoints = match store::open(&layout.checkpoints).await {
                Ok(store) => store,
                Err(err) => return fail(EXIT_STORAGE, &err.to_string()),
            };
            let snapshots = match store::open(&layout.snapshots).await {
                Ok(store) => store,
                Err(err) => return fail(EXIT_STORAGE, &err.to_string()),
            };
            let retention = (snapshot_retention_days > 0)
                .then(|| chrono::Duration::days(snapshot_retention_days));
            let snapshots_found = match ctl::gc_snapshots(
                snapshots.as_ref(),
                retention,
                chrono::Duration::seconds(older_than_s),
                now,
                dry_run,
            )
            .await
            {
                Ok(found) => found,
                Err(err) => return fail(err.exit_code(), &err.to_string()),
            };
            match ctl::gc(
                store.as_ref(),
                checkpoints.as_ref(),
                chrono::Duration::seconds(older_than_s),
                now,
                dry_run,
                keep_checkpoints,
            )
            .await
            {
                Ok(found) => {
                    let verb = if dry_run { "would remove" } else { "removed" };
                    for id in &found.tombstones {
                        println!("{verb} deleted sandbox {id}");
                    }
                    for id in &found.failed {
                        println!("{verb} failed sandbox {id} (never checkpointed)");
                    }
                    for id in &found.trimmed {
                        println!("{verb} superseded checkpoint {id}");
                    }
                    for skipped in &found.skipped {
                        println!("skipped {skipped}");
                    }
                    for id in &found.orphan_checkpoints {
                        println!("{verb} unreferenced checkpoint {id}");
                    }
                    for path in &snapshots_found.expired {
                        println!("{verb} expired filesystem snapshot {path}");
                    }
                    for key in &snapshots_found.unreferenced_archives {
                        println!("{verb} superseded snapshot archive {key}");
                    }
                    println!(
                        "{} filesystem snapshots, {} snapshot archives",
                        snapshots_found.expired.len(),
                        snapshots_found.unreferenced_archives.len()
                    );
                    println!(
                        "{} tombstones, {} checkpoints{}",
                        found.tombstones.len(),
                        found.orphan_checkpoints.len() + found.trimmed.len(),
                        if dry_run {
                            " (dry run: nothing removed)"
                        } else {
                            ""
                        }
                    );
                    ExitCode::SUCCESS
                }
                Err(err) => fail(err.exit_code(), &err.to_string()),
            }
        }
        _ => ExitCode::SUCCESS,
    }
}

/// Asks the operator to type the id back.
fn confirm(id: &str) -> bool {
    eprint!(
        "Breaking the lease of {id} makes its holder stop it; the next attach restores its latest checkpoint.\nType the sandbox id to confirm: "
    );
    let mut answer = String::new();
    std::io::stdin().read_line(&mut answer).is_ok() && answer.trim() == id
}

fn fail(code: u8, message: &str) -> ExitCode {
    eprintln!("sandboxctl: {message}");
    ExitCode::from(code)
}
