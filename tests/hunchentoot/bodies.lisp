;;;; bodies.lisp -- bytes in, bytes out for Hunchentoot handlers on Gallop:
;;;; strings (UTF-8) with CR, LF, NUL and characters beyond ASCII, octet
;;;; vectors with every value, SEND-HEADERS streams and HANDLE-STATIC-FILE,
;;;; on GALLOP:EASY-ACCEPTOR and on a stock HUNCHENTOOT:EASY-ACCEPTOR with a
;;;; GALLOP:TASKMASTER.  Read back strictly, by READ-WIRE (tests/strict-reader.lisp),
;;;; on keep-alive connections (see tests/native/bodies.lisp for the exchange
;;;; runner and the random content).

(in-package #:gallop-tests)
(in-suite requests)

(defstruct ht-case
  id
  shape     ; :string :octets :send-headers :send-headers-length :static
  content   ; :string: the string; :octets: the vector; :send-headers*: the
            ; octet vectors written in turn; :static: the file
  flush     ; :send-headers*: FORCE-OUTPUT after each write
  expected) ; the octets the client must receive

(defvar *ht-body-cases* #()
  "The cases HANDLE-BODY-CASE answers, by index (global: handlers run in
worker threads).")

(hunchentoot:define-easy-handler (handle-body-case :uri "/body-case") (id)
  (let ((case (svref *ht-body-cases* (parse-integer id))))
    (setf (hunchentoot:content-type*) (if (eq (ht-case-shape case) :string)
                                          "text/plain; charset=utf-8"
                                          "application/octet-stream"))
    (flet ((write-pieces ()
             (let ((stream (hunchentoot:send-headers)))
               (dolist (piece (ht-case-content case))
                 (write-sequence piece stream)
                 (when (ht-case-flush case) (force-output stream)))
               nil)))
      (ecase (ht-case-shape case)
        ((:string :octets) (ht-case-content case))
        (:send-headers (write-pieces))
        (:send-headers-length
         (setf (hunchentoot:content-length*) (length (ht-case-expected case)))
         (write-pieces))
        (:static (hunchentoot:handle-static-file (ht-case-content case) "application/octet-stream"))))))

(defun build-ht-case (id shape pieces directory &key flush)
  "An HT-CASE whose body is PIECES (strings and octet vectors) in SHAPE."
  (let ((expected (pieces-octets pieces)))
    (make-ht-case
     :id id :shape shape :expected expected
     :flush (and flush (member shape '(:send-headers :send-headers-length)) t)
     :content (ecase shape
                (:string (assert (and (= 1 (length pieces)) (stringp (first pieces))))
                 (first pieces))
                (:octets (assert (and (= 1 (length pieces)) (not (stringp (first pieces)))))
                 (first pieces))
                ((:send-headers :send-headers-length) (mapcar #'piece-octets pieces))
                (:static (let ((path (merge-pathnames (format nil "case-~D" id) directory)))
                           (with-open-file (out path :direction :output :if-exists :supersede
                                                     :element-type '(unsigned-byte 8))
                             (write-sequence expected out))
                           path))))))

(defun fixed-ht-cases (directory)
  "The cases every run has: CR, LF, NUL and TAB in strings, characters
beyond ASCII, every octet value, and an empty body in each shape."
  (let ((id -1)
        (empty (make-array 0 :element-type '(unsigned-byte 8))))
    (flet ((case* (shape pieces &rest options)
             (apply #'build-ht-case (incf id) shape pieces directory options)))
      (list
       (case* :string (list (format nil "a~%b")))
       (case* :string (list (format nil "x~C~Cy~Cz~%~C~Cend~C" #\Return #\Linefeed #\Return
                                    (code-char 0) #\Tab #\Return)))
       (case* :string (list (coerce (loop for i below 128 collect (code-char i)) 'string)))
       (case* :string (list (coerce (list #\a (code-char #x3BB) (code-char #xE9) (code-char #x1F600)
                                          #\Newline (code-char #xFF))
                                    'string)))
       (case* :octets (list (all-octet-values)))
       (case* :send-headers (list (all-octet-values) (format nil "a~%b")) :flush t)
       (case* :send-headers-length (list (format nil "a~C~Cb" #\Return #\Linefeed) (all-octet-values)))
       (case* :static (list (all-octet-values)))
       (case* :string (list ""))
       (case* :octets (list empty))
       (case* :send-headers '())
       (case* :send-headers (list empty "") :flush t)
       (case* :send-headers-length '())
       (case* :static '())))))

(defun random-ht-case (rng id directory)
  (let ((shape (pick rng '(:string :string :octets :send-headers :send-headers-length :static))))
    (build-ht-case id shape
                   (ecase shape
                     (:string (list (random-string rng)))
                     (:octets (list (random-octets rng)))
                     ((:send-headers :send-headers-length :static)
                      (loop repeat (random 5 rng) collect (random-piece rng))))
                   directory
                   :flush (zerop (random 2 rng)))))

(defun ht-case-problems (case head response)
  (append (unless (eql 200 (wire-status response))
            (list (format nil "status ~D, 200 expected" (wire-status response))))
          (header-problems response
                           `(("Content-Type" . ,(if (eq (ht-case-shape case) :string)
                                                    "text/plain; charset=utf-8"
                                                    "application/octet-stream"))))
          (body-problems response (ht-case-expected case)
                         :head head :streamed (eq (ht-case-shape case) :send-headers))))

(defun ht-case-label (case head)
  (format nil "case ~D ~:[GET~;HEAD~] ~(~A~)~:[~; flushed~] [~{~A~^, ~}]"
          (ht-case-id case) head (ht-case-shape case) (ht-case-flush case)
          (let ((content (ht-case-content case)))
            (etypecase content
              (pathname (list (format nil "file ~D" (length (ht-case-expected case)))))
              (list (mapcar #'describe-piece content))
              (vector (list (describe-piece content)))))))

(defun check-ht-bodies (class &rest initargs)
  "Serve the seeded body cases with a CLASS acceptor and check every answer
(GET, and HEAD for some) on keep-alive connections."
  (let* ((rng (make-bodies-rng))
         (directory (uiop:ensure-directory-pathname
                     (format nil "/tmp/gallop-ht-bodies-~D-~D" (sb-posix:getpid) (random 1000000)))))
    (ensure-directories-exist directory)
    (unwind-protect
         (let* ((fixed (fixed-ht-cases directory))
                (cases (coerce (append fixed
                                       (loop for id from (length fixed) repeat 60
                                             collect (random-ht-case rng id directory)))
                               'simple-vector))
                (exchanges
                  (loop for case across cases
                        for id = (ht-case-id case)
                        append (loop for head in (if (or (< id (length fixed)) (zerop (random 3 rng)))
                                                     '(nil t)
                                                     '(nil))
                                     collect (let ((case case) (head head))
                                               (make-exchange
                                                :label (ht-case-label case head)
                                                :target (format nil "/body-case?id=~D" id)
                                                :head head
                                                :check (lambda (r) (ht-case-problems case head r))))))))
           (with-globals ((*ht-body-cases* cases))
             (let ((server (apply #'make-server class initargs)))
               (hunchentoot:start server)
               (unwind-protect
                    (is (= (length exchanges) (run-exchanges (port-of server) exchanges)))
                 (hunchentoot:stop server)))))
      (uiop:delete-directory-tree directory :validate t :if-does-not-exist :ignore))))

(test hunchentoot-bodies-arrive-exactly-on-gallop-easy-acceptor
  "Property: whatever a handler returns or writes, the client receives
exactly its octets (strings in UTF-8), framed right, on keep-alive."
  (check-ht-bodies 'gallop:easy-acceptor))

(test hunchentoot-bodies-arrive-exactly-on-a-stock-acceptor-with-gallop-taskmaster
  "The same on a stock HUNCHENTOOT:EASY-ACCEPTOR running GALLOP:TASKMASTER."
  (check-ht-bodies 'hunchentoot:easy-acceptor :taskmaster (make-instance 'gallop:taskmaster)))
