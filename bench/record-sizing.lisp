;;;; record-sizing.lisp -- record what the pool's sizing policy saw and
;;;; decided (sizing.lisp) under real loads, for tests/core/sizing.lisp to
;;;; replay without load.
;;;;
;;;;   scripts/lisp.sh --load bench/record-sizing.lisp --eval '(gallop-record-sizing:main)'
;;;;
;;;; One gallop:start server in this process (port 19201; /0 answers at
;;;; once, /1 after sleeping 1 ms), wrk on 127.0.0.1, each scenario from a
;;;; fresh pool:
;;;;
;;;;   cpu-hog   a busy loop on the last CPU, wrk -c100 on /0 for 3 s
;;;;   blocked   wrk -c100 on /1 for 2 s, then 3 s without load
;;;;   bursts    wrk -c50 on /1 for 1 s, then 0.5 s idle, four times
;;;;
;;;; Writes tests/data/sizing/SCENARIO.sexp: one line per group and sample,
;;;; (GROUP IDLE HOLDERS ALLOWED THREADS SHARE IDLE-SAMPLES LOAD CPUS-IDLE
;;;;  ROOM-FOR-PERMIT ROOM-FOR-THREAD LIMIT BLOCKED SATURATED
;;;;  BLOCKED-TO-CONFIRM CONFIRMED (BLOCKED-SAMPLES QUIET-LOOKS LOOK-IN
;;;;  SPARE-LOOKS) DECISION): LOAD exact (a ratio), the state the one before
;;;; the decision, LIMIT... what the look was asked and found, NIL where it
;;;; was not.  Needs wrk (scripts/deps.sh wrk).

(require :asdf)
(push (truename ".") asdf:*central-registry*)
(asdf:load-system "gallop/native")

(defpackage #:gallop-record-sizing
  (:use #:common-lisp)
  (:export #:main))
(in-package #:gallop-record-sizing)

(defparameter *port* 19201)

(defun app (env)
  (when (string= (getf env :path-info) "/1")
    (sleep 0.001))
  '(200 (:content-type "text/plain") ("Hey!")))

(defun wrk (connections seconds path)
  (sb-ext:run-program "/usr/bin/wrk"
                      (list "-t2" (format nil "-c~D" connections) (format nil "-d~As" seconds)
                            (format nil "http://127.0.0.1:~D~A" *port* path))
                      :output nil :error nil :wait t))

(defun record (name phases)
  "Run PHASES (thunks) against a fresh server; write the trace as NAME."
  (let* ((lines '())
         (lock (sb-thread:make-mutex))
         (server nil))
    ;; Set globally: the maker thread calls it.
    (setf gallop.core::*sizing-trace*
          (lambda (group sample before decision seen)
            (sb-thread:with-mutex (lock)
              (push (list group sample before decision (copy-list seen)) lines))))
    (unwind-protect (progn (setf server (gallop:start #'app :port *port* :address "127.0.0.1"))
                           (mapc #'funcall phases))
      (setf gallop.core::*sizing-trace* nil)
      (when server (gallop:stop server)))
    (let ((file (merge-pathnames (format nil "tests/data/sizing/~A.sexp" name) (truename "."))))
      (ensure-directories-exist file)
      (with-open-file (out file :direction :output :if-exists :supersede)
        (format out ";; bench/record-sizing.lisp, scenario ~A: ~D samples.~%" name (length lines))
        (dolist (line (reverse lines))
          (destructuring-bind (group sample before decision seen) line
            (let ((*print-pretty* nil))
              (format out "~S~%"
                      (list group (gallop.core::sample-idle sample) (gallop.core::sample-holders sample)
                            (gallop.core::sample-allowed sample) (gallop.core::sample-threads sample)
                            (gallop.core::sample-share sample)
                            (gallop.core::sample-idle-samples sample)
                            (rational (gallop.core::sample-load sample))
                            (and (gallop.core::sample-cpus-idle sample) t)
                            (and (gallop.core::sample-room-for-permit sample) t)
                            (and (gallop.core::sample-room-for-thread sample) t)
                            (first seen) (second seen) (and (third seen) t)
                            (fourth seen) (fifth seen)
                            (list (gallop.core::sizing-blocked-samples before)
                                  (gallop.core::sizing-quiet-looks before)
                                  (gallop.core::sizing-look-in before)
                                  (gallop.core::sizing-spare-looks before))
                            decision)))))
        (format t "~A: ~D samples, decisions ~S~%" name (length lines)
                (let ((counts '()))
                  (dolist (line lines counts)
                    (incf (getf counts (fourth line) 0)))))))))

(defun main ()
  (let ((hog nil))
    (record "cpu-hog"
            (list (lambda ()
                    (setf hog (sb-ext:run-program "/usr/bin/taskset"
                                                  (list "-c" (princ-to-string (1- (gallop.core::usable-cpus)))
                                                        "sh" "-c" "while :; do :; done")
                                                  :wait nil))
                    (sleep 0.5))
                  (lambda () (wrk 100 3 "/0"))
                  (lambda () (sb-ext:process-kill hog 9) (sb-ext:process-wait hog)))))
  (record "blocked" (list (lambda () (wrk 100 2 "/1")) (lambda () (sleep 3))))
  (record "bursts" (loop repeat 4
                         collect (lambda () (wrk 50 1 "/1"))
                         collect (lambda () (sleep 0.5))))
  (uiop:quit 0))
