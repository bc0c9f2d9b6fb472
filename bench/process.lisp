;;;; process.lisp -- helpers shared by the benchmark harness (run.lisp), the
;;;; soak test (soak.lisp) and the memory benchmarks (uploads.lisp,
;;;; heads.lisp), which each load this file first: reading
;;;; settings from the environment, and child processes.  Both start servers
;;;; and load generators as child processes and talk to them over pipes, with
;;;; every wait bounded.

(defpackage #:gallop-bench-process
  (:use #:common-lisp)
  (:export #:env #:env-int #:alive-p #:wait-exit #:kill-and-reap #:read-line-timeout
           #:*repo* #:lisp-sh))
(in-package #:gallop-bench-process)

(defparameter *repo*
  (uiop:pathname-parent-directory-pathname
   (uiop:pathname-directory-pathname (or *load-truename* *default-pathname-defaults*)))
  "The checkout this file belongs to.")

(defun lisp-sh ()
  "The checkout's scripts/lisp.sh, which child Lisp processes run."
  (namestring (merge-pathnames "scripts/lisp.sh" *repo*)))

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

(defun kill-and-reap (process)
  "SIGTERM PROCESS, SIGKILL it after 3 s, and release it."
  (when (alive-p process)
    (ignore-errors (sb-ext:process-kill process 15))
    (unless (wait-exit process 3)
      (ignore-errors (sb-ext:process-kill process 9))
      (wait-exit process 5)))
  (ignore-errors (sb-ext:process-close process)))

(defun read-line-timeout (stream seconds)
  "The next line of STREAM, or NIL at end of file or after SECONDS."
  (let ((deadline (+ (get-internal-real-time) (* seconds internal-time-units-per-second))))
    (loop
      (let ((c (read-char-no-hang stream nil :eof)))
        (cond ((eq c :eof) (return nil))
              (c (unread-char c stream) (return (read-line stream nil)))
              ((> (get-internal-real-time) deadline) (return nil))
              (t (sb-sys:wait-until-fd-usable (sb-sys:fd-stream-fd stream) :input 0.1)))))))
