;;;; perf-map.lisp -- name the Lisp functions in `perf report`.
;;;;
;;;; perf(1) resolves addresses in anonymous executable memory through
;;;; /tmp/perf-PID.map ("START SIZE NAME" per line, hex).  Load this file into
;;;; a running server (after (require :sb-posix)), warm it up, run
;;;; (WRITE-PERF-MAP), then `perf record -g -p PID` under load: Gallop's
;;;; functions then appear by name beside the kernel's.  Functions of SBCL's
;;;; own core are mapped from the core file, which perf does not read through
;;;; the map; resolve their addresses against the same file by hand.  Code in
;;;; SBCL's immobile space (where compiled files load on x86-64) does not move,
;;;; so the map stays valid for the life of the process.

(defun write-perf-map ()
  "Write /tmp/perf-PID.map for all code in this image, one line per function;
return the number of lines."
  (let ((path (format nil "/tmp/perf-~D.map" (sb-posix:getpid)))
        (n 0))
    (with-open-file (out path :direction :output :if-exists :supersede)
      (sb-vm:map-allocated-objects
       (lambda (obj type size)
         (declare (ignore size))
         (when (= type sb-vm:code-header-widetag)
           (let* ((nfuns (sb-kernel:code-n-entries obj))
                  (text-start (sb-sys:sap-int (sb-kernel:code-instructions obj)))
                  (text-end (+ text-start (sb-kernel:%code-text-size obj))))
             (dotimes (i nfuns)
               (let* ((f (sb-kernel:%code-entry-point obj i))
                      (start (sb-kernel:get-lisp-obj-address f))
                      (end (if (< (1+ i) nfuns)
                               (sb-kernel:get-lisp-obj-address (sb-kernel:%code-entry-point obj (1+ i)))
                               text-end)))
                 (incf n)
                 (format out "~X ~X ~A~%" start (max 1 (- end start))
                         (substitute #\_ #\Newline
                                     (let ((*package* (find-package :keyword)))
                                       (prin1-to-string (sb-kernel:%simple-fun-name f))))))))))
       :all))
    n))
