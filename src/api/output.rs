//! One execution's output, owned by the sandbox rather than by a socket: a pump
//! task reads the runtime's events into a bounded log whether or not a client
//! is attached, and the attached session streams the log out. A client that
//! drops mid-execution and comes back with `reconnect` gets what it missed.
//!
//! Guarantees on the wire: `SANDBOX_EXECUTION_DONE` exactly once, after the
//! extension event `exit_code`; after a `kill_process`, `FORCE_KILLED` comes
//! before `DONE` (upstream raced them, bug B4); UTF-8 split across chunks is
//! decoded whole (bug B2). The log keeps at most [`MAX_BUFFERED_BYTES`] of
//! undelivered output: beyond that the oldest is dropped and the reader is told
//! how much, on stderr.
//!
//! Each frame remembers the number of the runtime event it came from (0 for
//! the server's own frames), so that a resumable execution's runtime knows
//! what reached a client when the execution moves with its sandbox
//! (`ExecControl::begin_delivery`).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use controllers::clock::Clock;
use controllers::runtime::{ExecControl, ExecEvent, Execution};
use tokio::sync::{Notify, mpsc};

use super::protocol::{ServerFrame, Status, Utf8Stream};

/// Undelivered output kept per execution.
pub const MAX_BUFFERED_BYTES: usize = 8 << 20;

/// How long the pump waits for a kill in progress to report FORCE_KILLED.
const KILL_REPORT_WAIT: Duration = Duration::from_secs(5);

#[derive(Debug, Default)]
struct Log {
    /// (number of the runtime event it came from or 0, frame)
    frames: VecDeque<(u64, ServerFrame)>,
    bytes: usize,
    dropped_bytes: usize,
    /// DONE is in the log: nothing more will be added.
    finished: bool,
    /// A kill_process is between "asked" and "reported".
    killing: bool,
    /// The runtime killed it for a forced checkpoint (a handoff's or a
    /// shutdown's): its FORCE_KILLED is in the log, or about to be.
    killed_by_checkpoint: bool,
}

/// A running or finished execution.
#[derive(Debug)]
pub struct ExecutionState {
    log: Mutex<Log>,
    changed: Notify,
    control: Box<dyn ExecControl>,
    /// The instance's clock (the wait for a kill's report runs on it).
    clock: Arc<dyn Clock>,
}

fn frame_bytes(frame: &ServerFrame) -> usize {
    match frame {
        ServerFrame::Stdout(data) | ServerFrame::Stderr(data) => data.len(),
        ServerFrame::Result(_, size) => *size,
        _ => 0,
    }
}

impl ExecutionState {
    /// Starts pumping `execution`'s events; `on_exit` runs once it has ended.
    pub fn start(
        execution: Execution,
        clock: Arc<dyn Clock>,
        on_exit: impl FnOnce() + Send + 'static,
    ) -> Arc<Self> {
        let state = Arc::new(Self {
            log: Mutex::new(Log::default()),
            changed: Notify::new(),
            control: execution.control,
            clock,
        });
        tokio::spawn(Arc::clone(&state).pump(execution.events, on_exit));
        state
    }

    fn log(&self) -> MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn push(&self, frame: ServerFrame) {
        self.push_event(0, frame);
    }

    /// Pushes a frame made of the output of runtime events up to `event`.
    fn push_event(&self, event: u64, frame: ServerFrame) {
        let mut dropped_up_to = 0;
        {
            let mut log = self.log();
            log.bytes += frame_bytes(&frame);
            log.frames.push_back((event, frame));
            while log.bytes > MAX_BUFFERED_BYTES {
                let Some(position) = log.frames.iter().position(|(_, f)| {
                    matches!(
                        f,
                        ServerFrame::Stdout(_) | ServerFrame::Stderr(_) | ServerFrame::Result(..)
                    )
                }) else {
                    break;
                };
                if let Some((number, dropped)) = log.frames.remove(position) {
                    let size = frame_bytes(&dropped);
                    log.bytes -= size;
                    log.dropped_bytes += size;
                    dropped_up_to = dropped_up_to.max(number);
                }
            }
        }
        if dropped_up_to > 0 {
            self.control.dropped(dropped_up_to);
        }
        self.changed.notify_waiters();
    }

    async fn pump(
        self: Arc<Self>,
        mut events: mpsc::Receiver<ExecEvent>,
        on_exit: impl FnOnce() + Send + 'static,
    ) {
        let mut stdout = Utf8Stream::default();
        let mut stderr = Utf8Stream::default();
        let mut exit_code = None;
        let mut after_exec_failed = None;
        let mut hold_lost = false;
        let mut number = 0;
        while let Some(event) = events.recv().await {
            // Not output events: no number of their own.
            match event {
                ExecEvent::AfterExecFailed(message) => {
                    after_exec_failed = Some(message);
                    continue;
                }
                ExecEvent::ForceKilled => {
                    self.log().killed_by_checkpoint = true;
                    continue;
                }
                _ => {}
            }
            number += 1;
            match event {
                ExecEvent::Stdout(chunk) => {
                    let text = stdout.push(&chunk);
                    if !text.is_empty() {
                        self.push_event(number, ServerFrame::Stdout(text));
                    }
                }
                ExecEvent::Stderr(chunk) => {
                    let text = stderr.push(&chunk);
                    if !text.is_empty() {
                        self.push_event(number, ServerFrame::Stderr(text));
                    }
                }
                ExecEvent::Result(json) => match serde_json::from_slice::<serde_json::Value>(&json)
                {
                    Ok(result) if result["data"].is_object() => {
                        self.push_event(number, ServerFrame::Result(result, json.len()));
                    }
                    _ => self.push_event(
                        number,
                        ServerFrame::Stderr(
                            "[sandboxd] a rich result was lost: the sandbox sent it unreadable\n"
                                .to_owned(),
                        ),
                    ),
                },
                ExecEvent::Exited(code) => {
                    exit_code = Some((number, code));
                    break;
                }
                ExecEvent::HoldLost => {
                    hold_lost = true;
                    break;
                }
                ExecEvent::AfterExecFailed(_) | ExecEvent::ForceKilled => {}
            }
        }
        for (rest, frame) in [
            (
                stdout.finish(),
                ServerFrame::Stdout as fn(String) -> ServerFrame,
            ),
            (stderr.finish(), ServerFrame::Stderr),
        ] {
            if !rest.is_empty() {
                self.push_event(number, frame(rest));
            }
        }
        if hold_lost {
            // Another instance holds the sandbox now: nothing ends here (the
            // session reports the loss); the log ends without DONE, which
            // would acknowledge work on two instances at once.
            self.log().finished = true;
            self.changed.notify_waiters();
            on_exit();
            return;
        }
        // A kill in progress reports FORCE_KILLED first.
        let deadline = self.clock.instant() + KILL_REPORT_WAIT;
        loop {
            let changed = self.changed.notified();
            if !self.log().killing || self.clock.instant() >= deadline {
                break;
            }
            let _ = tokio::time::timeout_at(deadline, changed).await;
        }
        if self.log().killed_by_checkpoint {
            self.push(ServerFrame::status(Status::ExecutionForceKilled));
        }
        // The upload after the execution failed: an execution error before
        // DONE (the clients attribute it to the running process), so a
        // client never takes DONE for "stored".
        if let Some(message) = after_exec_failed {
            self.push(ServerFrame::status_with(
                Status::ExecutionError,
                message.clone(),
            ));
            self.push(ServerFrame::Error(message));
        }
        match exit_code {
            Some((number, code)) => self.push_event(number, ServerFrame::ExitCode(code)),
            None => self.push(ServerFrame::Stderr(
                "[sandboxd] the execution ended without an exit status (the sandbox stopped)\n"
                    .to_owned(),
            )),
        }
        {
            let mut log = self.log();
            log.frames
                .push_back((0, ServerFrame::status(Status::ExecutionDone)));
            log.finished = true;
        }
        self.changed.notify_waiters();
        on_exit();
    }

    /// True until the execution has ended (DONE is in the log).
    pub fn is_running(&self) -> bool {
        !self.log().finished
    }

    /// Resolves once the execution has ended (DONE is in the log).
    pub async fn ended(&self) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if !self.is_running() {
                return;
            }
            changed.await;
        }
    }

    /// True while the log holds frames nobody has read.
    pub fn has_undelivered(&self) -> bool {
        !self.log().frames.is_empty()
    }

    pub async fn write_stdin(
        &self,
        data: bytes::Bytes,
    ) -> Result<(), controllers::runtime::RuntimeError> {
        self.control.write_stdin(data).await
    }

    /// Resizes the execution's terminal.
    pub async fn resize(
        &self,
        size: controllers::runtime::TerminalSize,
    ) -> Result<(), controllers::runtime::RuntimeError> {
        self.control.resize(size).await
    }

    /// Kills the execution and reports it in order: `FORCE_KILLED` (or
    /// `FORCE_KILL_ERROR`) before `DONE`. Returns false if it had already
    /// ended, in which case the caller answers directly.
    pub async fn kill(&self) -> bool {
        {
            let mut log = self.log();
            if log.finished {
                return false;
            }
            log.killing = true;
        }
        let outcome = self.control.kill().await;
        match outcome {
            Ok(()) => self.push(ServerFrame::status(Status::ExecutionForceKilled)),
            Err(err) => {
                self.push(ServerFrame::status_with(
                    Status::ExecutionForceKillError,
                    err.to_string(),
                ));
                self.push(ServerFrame::Error(format!(
                    "Failed to kill the process: {err}"
                )));
            }
        }
        self.log().killing = false;
        self.changed.notify_waiters();
        true
    }

    /// True once the runtime said it killed this execution for a forced
    /// checkpoint: its end is reported as FORCE_KILLED, as upstream's handoff
    /// did, after the session's LOCK_RELEASE_REQUESTED and CHECKPOINTING
    /// (the streamer waits for its relay to say them).
    pub fn killed_by_checkpoint(&self) -> bool {
        self.log().killed_by_checkpoint
    }

    /// The next frame to send with the number of the runtime event it came
    /// from, waiting for one; `None` once DONE has been sent. The frame stays
    /// in the log until [`Self::sent`]: a streamer stopped before it sent it
    /// leaves it for the next one.
    pub async fn next_frame(&self) -> Option<(u64, ServerFrame)> {
        loop {
            let changed = self.changed.notified();
            {
                let mut log = self.log();
                if log.dropped_bytes > 0 {
                    let notice = ServerFrame::Stderr(format!(
                        "[sandboxd] {} bytes of output were dropped: nobody read them and \
                         the replay buffer keeps {MAX_BUFFERED_BYTES} bytes\n",
                        log.dropped_bytes
                    ));
                    log.dropped_bytes = 0;
                    log.bytes += frame_bytes(&notice);
                    log.frames.push_front((0, notice));
                }
                if let Some(frame) = log.frames.front() {
                    return Some(frame.clone());
                }
                if log.finished {
                    return None;
                }
            }
            changed.await;
        }
    }

    /// The frame [`Self::next_frame`] returned is on its way to the client.
    pub fn sent(&self) {
        let mut log = self.log();
        if let Some((_, frame)) = log.frames.pop_front() {
            log.bytes -= frame_bytes(&frame);
        }
    }

    /// May the frame of runtime event `event` go to a client now? `false`
    /// while the execution is being moved with its sandbox (then, if the
    /// move succeeds, never again here). A `true` needs an
    /// [`Self::end_delivery`].
    pub fn begin_delivery(&self, event: u64) -> bool {
        self.control.begin_delivery(event)
    }

    /// Ends [`Self::begin_delivery`]: whether the socket's writer took it.
    pub fn end_delivery(&self, event: u64, delivered: bool) {
        self.control.end_delivery(event, delivered);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_trait::async_trait;
    use bytes::Bytes;
    use controllers::runtime::RuntimeError;

    #[derive(Debug)]
    struct Killable(mpsc::Sender<ExecEvent>);

    #[async_trait]
    impl ExecControl for Killable {
        async fn write_stdin(&self, _data: Bytes) -> Result<(), RuntimeError> {
            Ok(())
        }
        async fn close_stdin(&self) -> Result<(), RuntimeError> {
            Ok(())
        }
        async fn kill(&self) -> Result<(), RuntimeError> {
            // The process dies at once; the report must still come first.
            let _ = self.0.send(ExecEvent::Exited(137)).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            Ok(())
        }
    }

    fn start() -> (mpsc::Sender<ExecEvent>, Arc<ExecutionState>) {
        let (sender, events) = mpsc::channel(1024);
        let state = ExecutionState::start(
            Execution {
                events,
                control: Box::new(Killable(sender.clone())),
            },
            Arc::new(controllers::clock::SystemClock),
            || {},
        );
        (sender, state)
    }

    async fn all_frames(state: &ExecutionState) -> Vec<ServerFrame> {
        let mut frames = Vec::new();
        while let Some((_, frame)) = state.next_frame().await {
            state.sent();
            frames.push(frame);
        }
        frames
    }

    #[tokio::test]
    async fn force_killed_comes_before_done_even_when_the_exit_arrives_first() {
        let (_sender, state) = start();
        assert!(state.kill().await);
        let frames = all_frames(&state).await;
        assert_eq!(
            frames,
            vec![
                ServerFrame::status(Status::ExecutionForceKilled),
                ServerFrame::ExitCode(137),
                ServerFrame::status(Status::ExecutionDone),
            ]
        );
        assert!(
            !state.kill().await,
            "a finished execution is not killed twice"
        );
    }

    /// An execution whose hold was lost ends without DONE (and without the
    /// "sandbox stopped" line a plain end of events gets): the output
    /// before it is delivered, and the log is finished.
    #[tokio::test]
    async fn a_lost_hold_ends_the_log_without_done() {
        let (sender, state) = start();
        sender
            .send(ExecEvent::Stdout(Bytes::from_static(b"before\n")))
            .await
            .unwrap();
        sender.send(ExecEvent::HoldLost).await.unwrap();
        let frames = all_frames(&state).await;
        assert_eq!(frames, vec![ServerFrame::Stdout("before\n".to_owned())]);
        assert!(!state.is_running());
    }

    /// Stands for a resumable execution's runtime: records what the log
    /// says it delivered or dropped, and can be frozen.
    #[derive(Debug, Default)]
    struct Recorder {
        frozen: std::sync::atomic::AtomicBool,
        delivered: Mutex<Vec<u64>>,
        dropped: Mutex<Vec<u64>>,
    }

    #[derive(Debug)]
    struct Shared(Arc<Recorder>);

    #[async_trait]
    impl ExecControl for Shared {
        async fn write_stdin(&self, _data: Bytes) -> Result<(), RuntimeError> {
            Ok(())
        }
        async fn close_stdin(&self) -> Result<(), RuntimeError> {
            Ok(())
        }
        async fn kill(&self) -> Result<(), RuntimeError> {
            Ok(())
        }
        fn begin_delivery(&self, _event: u64) -> bool {
            !self.0.frozen.load(std::sync::atomic::Ordering::SeqCst)
        }
        fn end_delivery(&self, event: u64, delivered: bool) {
            if delivered {
                self.0.delivered.lock().unwrap().push(event);
            }
        }
        fn dropped(&self, event: u64) {
            self.0.dropped.lock().unwrap().push(event);
        }
    }

    #[tokio::test]
    async fn frames_carry_the_number_of_the_event_they_came_from() {
        let (sender, events) = mpsc::channel(16);
        let recorder = Arc::new(Recorder::default());
        let state = ExecutionState::start(
            Execution {
                events,
                control: Box::new(Shared(Arc::clone(&recorder))),
            },
            Arc::new(controllers::clock::SystemClock),
            || {},
        );
        // Event 2 is half a character: its frame comes with event 3.
        for chunk in [&b"a"[..], &[0xC3], &[0xA9, b'b'], b"c"] {
            sender
                .send(ExecEvent::Stdout(Bytes::copy_from_slice(chunk)))
                .await
                .unwrap();
        }
        sender.send(ExecEvent::Exited(0)).await.unwrap();
        let mut numbered = Vec::new();
        while let Some((event, frame)) = state.next_frame().await {
            assert!(state.begin_delivery(event));
            state.end_delivery(event, true);
            state.sent();
            numbered.push((event, frame));
        }
        assert_eq!(
            numbered,
            vec![
                (1, ServerFrame::Stdout("a".into())),
                (3, ServerFrame::Stdout("éb".into())),
                (4, ServerFrame::Stdout("c".into())),
                (5, ServerFrame::ExitCode(0)),
                (0, ServerFrame::status(Status::ExecutionDone)),
            ]
        );
        assert_eq!(*recorder.delivered.lock().unwrap(), vec![1, 3, 4, 5, 0]);
    }

    #[tokio::test]
    async fn output_dropped_from_a_full_log_is_reported_to_the_runtime() {
        let (sender, events) = mpsc::channel(16);
        let recorder = Arc::new(Recorder::default());
        let state = ExecutionState::start(
            Execution {
                events,
                control: Box::new(Shared(Arc::clone(&recorder))),
            },
            Arc::new(controllers::clock::SystemClock),
            || {},
        );
        let chunk = Bytes::from(vec![b'x'; 1 << 20]);
        for _ in 0..(MAX_BUFFERED_BYTES >> 20) + 2 {
            sender.send(ExecEvent::Stdout(chunk.clone())).await.unwrap();
        }
        sender.send(ExecEvent::Exited(0)).await.unwrap();
        while state.is_running() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            recorder.dropped.lock().unwrap().last(),
            Some(&2),
            "the two oldest events were dropped"
        );
    }

    #[tokio::test]
    async fn a_character_split_between_chunks_arrives_whole() {
        let (sender, state) = start();
        let text = "a".to_owned() + &"é".repeat(600);
        for chunk in text.as_bytes().chunks(1024) {
            sender
                .send(ExecEvent::Stdout(Bytes::copy_from_slice(chunk)))
                .await
                .unwrap();
        }
        sender.send(ExecEvent::Exited(0)).await.unwrap();
        let stdout: String = all_frames(&state)
            .await
            .into_iter()
            .filter_map(|f| match f {
                ServerFrame::Stdout(data) => Some(data),
                _ => None,
            })
            .collect();
        assert_eq!(stdout, text);
    }

    #[tokio::test]
    async fn undelivered_output_is_bounded_and_the_loss_is_reported() {
        let (sender, state) = start();
        let chunk = Bytes::from(vec![b'x'; 64 << 10]);
        let total = MAX_BUFFERED_BYTES * 2;
        for _ in 0..total / chunk.len() {
            sender.send(ExecEvent::Stdout(chunk.clone())).await.unwrap();
        }
        sender.send(ExecEvent::Exited(0)).await.unwrap();
        while state.is_running() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let frames = all_frames(&state).await;
        let ServerFrame::Stderr(notice) = &frames[0] else {
            panic!("expected the loss notice first, got {:?}", frames[0]);
        };
        assert!(notice.contains("bytes of output were dropped"), "{notice}");
        let kept: usize = frames[1..].iter().map(frame_bytes).sum();
        assert!(kept <= MAX_BUFFERED_BYTES, "kept {kept}");
        assert_eq!(
            frames.last(),
            Some(&ServerFrame::status(Status::ExecutionDone))
        );
    }
}
