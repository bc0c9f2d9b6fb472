;;;; process.lisp -- helpers shared by the benchmark harness (run.lisp) and
;;;; the soak test (soak.lisp), which each load this file first: reading
;;;; settings from the environment, and child processes.  Both start servers
;;;; and load generators as child processes and talk to them over pipes, with
;;;; every wait bounded.

(defpackage #:gallop-bench-process
  (:use #:common-lisp)
  (:export #:env #:env-int #:alive-p #:wait-exit #:read-line-timeout))
(in-package #:gallop-bench-process)

(defun env (name)
  "The environment variable NAME, trimmed, or NIL when unset or blank."
  (let ((v (uiop:getenv name)))
    (and v (plusp (length (string-trim " " v))) (string-trim " " v))))

(defun env-int (name default)
  "The integer in the environment variable NAME (underscores allowed as
separators: 2_000_000), or DEFAULT when unset."
  (let ((v (env name)))
    (if v
        (or (parse-integer (remove #\_ v) :junk-allowed t)
            (error "~A=~S is not an integer" name v))
        default)))

(defun alive-p (process)
  "True while PROCESS runs (or is stopped)."
  (and process (member (sb-ext:process-status process) '(:running :stopped))))

(defun wait-exit (process seconds)
  "Wait up to SECONDS for PROCESS to exit; true if it did."
  (loop with deadline = (+ (get-internal-real-time) (* seconds internal-time-units-per-second))
        while (alive-p process)
        do (when (> (get-internal-real-time) deadline)
             (return-from wait-exit nil))
           (sleep 0.05))
  t)

(defun read-line-timeout (stream seconds)
  "The next line of STREAM, or NIL at end of file or after SECONDS."
  (let ((deadline (+ (get-internal-real-time) (* seconds internal-time-units-per-second))))
    (loop
      (let ((c (read-char-no-hang stream nil :eof)))
        (cond ((eq c :eof) (return nil))
              (c (unread-char c stream) (return (read-line stream nil)))
              ((> (get-internal-real-time) deadline) (return nil))
              (t (sb-sys:wait-until-fd-usable (sb-sys:fd-stream-fd stream) :input 0.1)))))))
